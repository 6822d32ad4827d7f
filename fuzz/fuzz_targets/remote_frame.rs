//! A remote frame after the handshake, up to its tensors' bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = cuda_mp::testing::fuzz::remote_frame(data);
    cuda_mp_fuzz::check_descriptors();
});
