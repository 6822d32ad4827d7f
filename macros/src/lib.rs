//! Attribute macros for cuda-mp.
#![deny(missing_docs)]

use proc_macro::TokenStream;
use quote::quote;
use syn::{ItemFn, parse_macro_input};

/// Marks the program's `main`: runs `cuda_mp::init()` before its body, so that spawned worker
/// processes run their function instead of `main`.
///
/// ```ignore
/// #[cuda_mp::main]
/// fn main() {
///     // spawn workers, create channels ...
/// }
/// ```
///
/// With an async runtime's attribute, in either order, `init()` runs before the runtime
/// starts (a worker then runs its function without one):
///
/// ```ignore
/// #[cuda_mp::main]
/// #[tokio::main]
/// async fn main() {
///     // ...
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
    if sig.ident != "main" || !sig.inputs.is_empty() || !sig.generics.params.is_empty() {
        return syn::Error::new_spanned(&sig, "#[cuda_mp::main] goes on a plain `fn main()`").to_compile_error().into();
    }
    if sig.asyncness.is_none() {
        // A sync `main`, or one that a runtime's attribute above this one has already turned
        // into a sync function that starts the runtime: init() goes first in it.
        return quote! {
            #(#attrs)*
            #vis #sig {
                ::cuda_mp::init();
                #block
            }
        }
        .into();
    }
    // An async `main` whose runtime attribute (still among `attrs`) has yet to run: that
    // attribute goes on an inner function, and init() runs before it starts the runtime.
    if attrs.is_empty() {
        return syn::Error::new_spanned(
            &sig,
            "an async `main` needs its runtime's attribute (such as #[tokio::main]) beside #[cuda_mp::main]",
        )
        .to_compile_error()
        .into();
    }
    let output = &sig.output;
    quote! {
        #vis fn main() #output {
            ::cuda_mp::init();
            #(#attrs)*
            async fn __cuda_mp_main() #output #block
            __cuda_mp_main()
        }
    }
    .into()
}
