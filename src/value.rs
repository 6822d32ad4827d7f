//! `Value`: an object that Python and Rust processes both read, what the Python package's
//! `cuda_mp.Queue` and `cuda_mp.Pipe` carry.

use std::cell::Cell;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

#[cfg(feature = "cuda")]
use crate::gpu::GpuStorage;
use crate::host::HostStorage;
use crate::tensor::DynTensor;

/// An object as Python and Rust processes both read it: what the Python package's
/// `cuda_mp.Queue` and `cuda_mp.Pipe` carry, so that a Rust process can put to or get from a
/// queue that Python programs use (`Queue<Value>`, its handle's bytes from the Python queue's
/// `to_bytes`), or be one end of a Python pipe.
///
/// Python puts an object as a tree of these when it is made of `None`, `bool`, `int` (64 bits),
/// `float`, `str`, `bytes`, `list`, `tuple`, `dict`, CUDA `torch.Tensor`s and NumPy arrays in
/// cuda-mp memory; anything else travels [`Pickled`](Value::Pickled). Tensors are shared, not
/// copied: a [`Host`](Value::Host) tensor is a NumPy array in Python, a [`Gpu`](Value::Gpu)
/// tensor a CUDA `torch.Tensor` (where torch is installed).
///
/// ```
/// use cuda_mp::{HostTensor, Queue, Value};
///
/// let queue = Queue::<Value>::new()?;
/// let weights = HostTensor::<f32>::full(&[4], 0.5)?;
/// queue.put(Value::Dict(vec![("step".into(), Value::Int(3)), ("w".into(), Value::Host(weights.into()))]))?;
/// let got = queue.consumer().get()?;
/// assert_eq!(got.get("step").and_then(Value::as_int), Some(3));
/// let Some(Value::Host(w)) = got.get("w") else { unreachable!() };
/// assert_eq!(w.typed::<f32>()?.to_vec(), vec![0.5; 4]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Value {
    /// Python's `None`.
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int` that fits in 64 bits.
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `bytes`.
    Bytes(#[serde(with = "serde_bytes")] Vec<u8>),
    /// A `list`.
    List(#[serde(deserialize_with = "nested")] Vec<Value>),
    /// A `tuple`.
    Tuple(#[serde(deserialize_with = "nested")] Vec<Value>),
    /// A `dict`, its items in order.
    Dict(#[serde(deserialize_with = "nested")] Vec<(Value, Value)>),
    /// A host tensor (a NumPy array in Python).
    Host(DynTensor<HostStorage>),
    /// An object only Python reads: its pickle, made with the tensors it holds left out (they
    /// travel beside it, shared, as [`Host`](Value::Host) and [`Gpu`](Value::Gpu) values, in
    /// the order the pickle names them).
    Pickled {
        /// The pickle (Python's `pickle` protocol, with persistent ids for the tensors).
        #[serde(with = "serde_bytes")]
        pickle: Vec<u8>,
        /// The tensors it names.
        #[serde(deserialize_with = "nested")]
        tensors: Vec<Value>,
    },
    /// A GPU tensor (a CUDA `torch.Tensor` in Python).
    #[cfg(feature = "cuda")]
    Gpu(DynTensor<GpuStorage>),
}

/// The deepest nesting of containers a received value may have: a message of ever deeper lists
/// (two bytes a level) would otherwise take the decoding thread's stack.
const MAX_DEPTH: usize = 128;

thread_local! {
    /// Containers being decoded on this thread, one inside the other.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Decodes a container's items one level deeper; refuses past [`MAX_DEPTH`]. Room is made as
/// items arrive, not as the count in the message says: serde's own `Vec` reserves up to 1 MiB
/// on that word alone, so a few hundred bytes of nested headers would reserve a hundred MiB.
fn nested<'de, D: Deserializer<'de>, T: Deserialize<'de>>(deserializer: D) -> Result<Vec<T>, D::Error> {
    struct Items<T>(std::marker::PhantomData<T>);

    impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Items<T> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a sequence")
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut items = Vec::new();
            while let Some(item) = seq.next_element()? {
                items.push(item);
            }
            Ok(items)
        }
    }

    let level = DEPTH.with(Cell::get) + 1;
    if level > MAX_DEPTH {
        return Err(D::Error::custom(format!("a value nested deeper than {MAX_DEPTH} containers")));
    }
    DEPTH.with(|d| d.set(level));
    let items = deserializer.deserialize_seq(Items(std::marker::PhantomData));
    DEPTH.with(|d| d.set(level - 1));
    items
}

impl Value {
    /// The value under the key `key` of a [`Dict`](Value::Dict) (the first, when several).
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items.iter().find(|(k, _)| matches!(k, Value::Str(s) if s == key)).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The integer of an [`Int`](Value::Int).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The text of a [`Str`](Value::Str).
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The items of a [`List`](Value::List) or a [`Tuple`](Value::Tuple).
    pub fn as_slice(&self) -> Option<&[Value]> {
        match self {
            Value::List(items) | Value::Tuple(items) => Some(items),
            _ => None,
        }
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Value {
        Value::Str(s.to_owned())
    }
}

macro_rules! from {
    ($($t:ty => $variant:ident),*) => {$(
        impl From<$t> for Value {
            fn from(x: $t) -> Value {
                Value::$variant(x)
            }
        }
    )*};
}

from!(String => Str, i64 => Int, f64 => Float, bool => Bool, DynTensor<HostStorage> => Host);
#[cfg(feature = "cuda")]
from!(DynTensor<GpuStorage> => Gpu);

#[cfg(test)]
mod tests {
    use super::*;

    fn nested_lists(depth: usize) -> Vec<u8> {
        // Postcard: `List` is variant 6, then the length of its items, here one.
        let mut bytes = [6u8, 1].repeat(depth);
        bytes.push(0);
        bytes
    }

    #[test]
    fn values_nested_past_the_limit_are_refused_not_a_stack_overflow() {
        let deep: Value = postcard::from_bytes(&nested_lists(MAX_DEPTH)).unwrap();
        assert!(matches!(deep, Value::List(_)));
        assert!(postcard::from_bytes::<Value>(&nested_lists(1_000_000)).is_err());
        assert!(postcard::from_bytes::<Value>(&nested_lists(MAX_DEPTH + 1)).is_err());
        // The count is back at zero after a refusal: the next value decodes.
        assert!(postcard::from_bytes::<Value>(&nested_lists(3)).is_ok());
    }
}
