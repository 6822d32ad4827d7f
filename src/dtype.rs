//! Element types: the runtime tag [`DType`] and the compile-time [`Element`] trait.

use std::fmt;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// The element type of a tensor.
///
/// ```
/// use cuda_mp::{bf16, DType, HostTensor};
/// let t = HostTensor::<bf16>::zeros(&[4]).unwrap();
/// assert_eq!(t.dtype(), DType::BF16);
/// assert_eq!(t.dtype().to_string(), "bf16");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
#[allow(missing_docs)]
pub enum DType {
    F32 = 0,
    F64 = 1,
    F16 = 2,
    BF16 = 3,
    I8 = 4,
    U8 = 5,
    I16 = 6,
    I32 = 7,
    I64 = 8,
    Bool = 9,
}

impl DType {
    /// Every dtype, in tag order.
    ///
    /// ```
    /// use cuda_mp::DType;
    /// assert_eq!(DType::ALL.len(), 10);
    /// assert!(DType::ALL.iter().enumerate().all(|(i, d)| d.tag() as usize == i));
    /// ```
    pub const ALL: [DType; 10] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::Bool,
    ];

    /// Size of one element in bytes.
    ///
    /// ```
    /// use cuda_mp::DType;
    /// assert_eq!(DType::BF16.size(), 2);
    /// assert_eq!(DType::I64.size(), std::mem::size_of::<i64>());
    /// ```
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The short name used in kernels and messages (`f32`, `bf16`, ...).
    ///
    /// ```
    /// assert_eq!(cuda_mp::DType::F16.name(), "f16");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
        }
    }

    /// The dtype with the given wire tag, if any.
    ///
    /// ```
    /// use cuda_mp::DType;
    /// assert_eq!(DType::from_tag(DType::I32.tag()), Some(DType::I32));
    /// assert_eq!(DType::from_tag(200), None);
    /// ```
    pub fn from_tag(tag: u8) -> Option<DType> {
        DType::ALL.get(tag as usize).copied()
    }

    /// The wire tag of this dtype.
    ///
    /// ```
    /// use cuda_mp::DType;
    /// assert_eq!(DType::F32.tag(), 0);
    /// assert_eq!(DType::Bool.tag(), 9);
    /// ```
    pub const fn tag(self) -> u8 {
        self as u8
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    /// The crate-private half of [`Element`](super::Element). The trait is `pub(crate)`, so
    /// its items cannot be called from outside the crate, not even as `T::from_bits` on a
    /// `T: Element` (a `pub` trait in a private module would still allow that).
    pub(crate) trait Sealed: Copy {
        /// The element whose bits are the low `size_of::<Self>()` bytes of `bits` (the layout
        /// [`Element::to_bits`](super::Element::to_bits) produces). Every bit pattern is a
        /// value: `bool` is `true` for any non-zero byte, since another process may have
        /// written any byte.
        fn from_bits(bits: u64) -> Self;
    }
}

/// A Rust type that can be a tensor element. Implemented for `f32`, `f64`, `half::f16`,
/// `half::bf16`, `i8`, `u8`, `i16`, `i32`, `i64` and `bool`; sealed (its crate-private
/// supertrait cannot be implemented or called from outside the crate).
///
/// ```
/// fn describe<T: cuda_mp::Element>(t: &cuda_mp::HostTensor<T>) -> String {
///     format!("{} x {}", T::DTYPE, t.numel())
/// }
/// assert_eq!(describe(&cuda_mp::HostTensor::<u8>::zeros(&[3]).unwrap()), "u8 x 3");
/// ```
///
/// Other types are not elements:
///
/// ```compile_fail,E0599
/// let t = cuda_mp::HostTensor::<u32>::zeros(&[4]); // u32 is not an element type
/// ```
///
/// ```compile_fail,E0277
/// // The list of element types is closed.
/// #[derive(Clone, Copy, Debug)]
/// struct Rgb(u8, u8, u8);
/// impl cuda_mp::Element for Rgb {
///     const DTYPE: cuda_mp::DType = cuda_mp::DType::U8;
///     fn to_bits(self) -> u64 {
///         0
///     }
/// }
/// ```
///
/// ```compile_fail,E0624
/// // The element conversions are the crate's own business.
/// fn decode<T: cuda_mp::Element>(bits: u64) -> T {
///     T::from_bits(bits)
/// }
/// ```
#[allow(private_bounds)] // the private supertrait is what seals the trait
pub trait Element: sealed::Sealed + Copy + Send + Sync + fmt::Debug + 'static {
    /// The runtime tag of this type.
    const DTYPE: DType;

    /// The element's bits, zero-extended to 64 bits (little endian), for kernel arguments.
    ///
    /// ```
    /// use cuda_mp::Element;
    /// assert_eq!(Element::to_bits(1.0f32), 0x3f80_0000);
    /// assert_eq!(Element::to_bits(-1i8), 0xff); // zero-extended, not sign-extended
    /// ```
    fn to_bits(self) -> u64;
}

macro_rules! element {
    ($t:ty, $d:expr, $to:expr, $from:expr) => {
        impl sealed::Sealed for $t {
            #[inline]
            fn from_bits(bits: u64) -> Self {
                let f: fn(u64) -> $t = $from;
                f(bits)
            }
        }
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn to_bits(self) -> u64 {
                let f: fn($t) -> u64 = $to;
                f(self)
            }
        }
    };
}

element!(f32, DType::F32, |v| v.to_bits() as u64, |b| f32::from_bits(b as u32));
element!(f64, DType::F64, |v| v.to_bits(), f64::from_bits);
element!(f16, DType::F16, |v| v.to_bits() as u64, |b| f16::from_bits(b as u16));
element!(bf16, DType::BF16, |v| v.to_bits() as u64, |b| bf16::from_bits(b as u16));
element!(i8, DType::I8, |v| v as u8 as u64, |b| b as u8 as i8);
element!(u8, DType::U8, |v| v as u64, |b| b as u8);
element!(i16, DType::I16, |v| v as u16 as u64, |b| b as u16 as i16);
element!(i32, DType::I32, |v| v as u32 as u64, |b| b as u32 as i32);
element!(i64, DType::I64, |v| v as u64, |b| b as i64);
// Another process may write any byte into a bool tensor: every non-zero byte reads as true.
element!(bool, DType::Bool, |v| v as u64, |b| b as u8 != 0);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_sizes_match_rust_types() {
        for d in DType::ALL {
            assert_eq!(DType::from_tag(d.tag()), Some(d));
        }
        assert_eq!(DType::from_tag(10), None);
        assert_eq!(DType::F16.size(), std::mem::size_of::<f16>());
        assert_eq!(DType::BF16.size(), std::mem::size_of::<bf16>());
        assert_eq!(DType::Bool.size(), std::mem::size_of::<bool>());
        assert_eq!(DType::I64.size(), std::mem::size_of::<i64>());
    }

    #[test]
    fn bool_from_bits_accepts_any_byte() {
        let bytes = [0u8, 1, 2, 255];
        let got: Vec<bool> = bytes.iter().map(|&b| <bool as sealed::Sealed>::from_bits(b as u64)).collect();
        assert_eq!(got, vec![false, true, true, true]);
    }

    fn round_trip<T: Element + PartialEq>(values: &[T]) {
        for &v in values {
            assert_eq!(T::from_bits(v.to_bits()), v, "{v:?}");
            let size = std::mem::size_of::<T>();
            assert!(size == 8 || v.to_bits() >> (8 * size) == 0, "{v:?} is not zero-extended");
        }
    }

    #[test]
    fn bits_round_trip_for_every_element_type() {
        round_trip(&[0.0f32, -1.5, f32::MAX, f32::MIN_POSITIVE, f32::INFINITY]);
        round_trip(&[0.0f64, -1.5, f64::MAX, f64::NEG_INFINITY]);
        round_trip(&[f16::from_f32(0.5), f16::MIN, f16::MAX]);
        round_trip(&[bf16::from_f32(-2.0), bf16::MIN, bf16::MAX]);
        round_trip(&[i8::MIN, -1, 0, i8::MAX]);
        round_trip(&[0u8, 7, u8::MAX]);
        round_trip(&[i16::MIN, -1, i16::MAX]);
        round_trip(&[i32::MIN, -1, i32::MAX]);
        round_trip(&[i64::MIN, -1, i64::MAX]);
        round_trip(&[false, true]);
        assert!(<f32 as sealed::Sealed>::from_bits(f32::NAN.to_bits() as u64).is_nan());
    }
}
