//! Bytes of `to_bytes`, as they arrive in the process that decodes them, and real ones edited.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = cuda_mp::testing::fuzz::handoff_bytes(data);
    cuda_mp_fuzz::check_descriptors();
});
