//! A channel frame with descriptors whose message is a `Value` (a Python queue's item).
#![no_main]
use cuda_mp::testing::fuzz;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (descriptors, bytes) = fuzz::split_frame_input(data);
    let _ = fuzz::value_frame(&descriptors, bytes);
    cuda_mp_fuzz::check_descriptors();
});
