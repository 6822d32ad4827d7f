//! The small records: the local transport's hello, PyTorch handle bytes, host bytes.
#![no_main]
use cuda_mp::testing::fuzz;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = fuzz::hello(data);
    let _ = fuzz::torch_handle(data);
    let _ = fuzz::host_bytes(data);
    cuda_mp_fuzz::check_descriptors();
});
