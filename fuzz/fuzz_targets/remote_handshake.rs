//! A remote peer's handshake messages.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = cuda_mp::testing::fuzz::remote_handshake(data);
    cuda_mp_fuzz::check_descriptors();
});
