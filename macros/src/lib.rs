//! Attribute macros for cuda-mp.
#![deny(missing_docs)]

use proc_macro::TokenStream;
use quote::quote;
use syn::{parse_macro_input, ItemFn};

/// Marks the program's `main`: runs `cuda_mp::init()` before its body, so that spawned worker
/// processes run their function instead of `main`.
///
/// ```ignore
/// #[cuda_mp::main]
/// fn main() {
///     // spawn workers, create channels ...
/// }
/// ```
#[proc_macro_attribute]
pub fn main(attr: TokenStream, item: TokenStream) -> TokenStream {
    if !attr.is_empty() {
        return syn::Error::new(proc_macro2::Span::call_site(), "#[cuda_mp::main] takes no arguments")
            .to_compile_error()
            .into();
    }
    let ItemFn { attrs, vis, sig, block } = parse_macro_input!(item as ItemFn);
    if sig.ident != "main" || sig.asyncness.is_some() || !sig.inputs.is_empty() {
        return syn::Error::new_spanned(&sig, "#[cuda_mp::main] goes on a plain `fn main()`").to_compile_error().into();
    }
    quote! {
        #(#attrs)*
        #vis #sig {
            ::cuda_mp::init();
            #block
        }
    }
    .into()
}
