//! A frame of the queue's protocol with descriptors, as the dispatcher or a consumer reads it.
#![no_main]
use cuda_mp::testing::fuzz;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (descriptors, bytes) = fuzz::split_frame_input(data);
    let _ = fuzz::queue_frame(&descriptors, bytes);
    cuda_mp_fuzz::check_descriptors();
});
