//! Element types: the runtime tag [`DType`] and the compile-time [`Element`] trait.

use std::fmt;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// The element type of a tensor.
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
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The short name used in kernels and messages (`f32`, `bf16`, ...).
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
    pub fn from_tag(tag: u8) -> Option<DType> {
        DType::ALL.get(tag as usize).copied()
    }

    /// The wire tag of this dtype.
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
    pub trait Sealed {}
}

/// A Rust type that can be a tensor element. Implemented for `f32`, `f64`, `half::f16`,
/// `half::bf16`, `i8`, `u8`, `i16`, `i32`, `i64` and `bool`; sealed.
pub trait Element: sealed::Sealed + Copy + Send + Sync + fmt::Debug + 'static {
    /// The runtime tag of this type.
    const DTYPE: DType;

    /// Reads one element from memory that another process may have written.
    ///
    /// # Safety
    /// `ptr` must be valid for a read of `size_of::<Self>()` bytes.
    unsafe fn load(ptr: *const Self) -> Self {
        // SAFETY: the caller guarantees `ptr` is readable.
        unsafe { ptr.read_unaligned() }
    }

    /// The element's bits, zero-extended to 64 bits (little endian), for kernel arguments.
    fn to_bits(self) -> u64;
}

macro_rules! element {
    ($t:ty, $d:expr, $bits:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            fn to_bits(self) -> u64 {
                let f: fn($t) -> u64 = $bits;
                f(self)
            }
        }
    };
}

element!(f32, DType::F32, |v| v.to_bits() as u64);
element!(f64, DType::F64, |v| v.to_bits());
element!(f16, DType::F16, |v| v.to_bits() as u64);
element!(bf16, DType::BF16, |v| v.to_bits() as u64);
element!(i8, DType::I8, |v| v as u8 as u64);
element!(u8, DType::U8, |v| v as u64);
element!(i16, DType::I16, |v| v as u16 as u64);
element!(i32, DType::I32, |v| v as u32 as u64);
element!(i64, DType::I64, |v| v as u64);

impl sealed::Sealed for bool {}
impl Element for bool {
    const DTYPE: DType = DType::Bool;

    unsafe fn load(ptr: *const Self) -> Self {
        // A byte written by another process may be neither 0 nor 1: read it as a byte.
        // SAFETY: the caller guarantees `ptr` is readable.
        unsafe { (ptr as *const u8).read() != 0 }
    }

    fn to_bits(self) -> u64 {
        self as u64
    }
}

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
    fn bool_load_accepts_any_byte() {
        let bytes = [0u8, 1, 2, 255];
        let got: Vec<bool> = bytes.iter().map(|b| unsafe { bool::load(b as *const u8 as *const bool) }).collect();
        assert_eq!(got, vec![false, true, true, true]);
    }
}
