//! What a machine without a usable GPU gets: errors, never panics.

use cuda_mp::{Device, Error, cuda_available};

#[test]
fn device_lookup_reports_errors_instead_of_panicking() {
    match Device::get(0) {
        Ok(dev) => assert!(cuda_available(), "found {dev:?} but cuda_available() says no"),
        Err(e) => {
            assert!(!cuda_available());
            assert!(matches!(e, Error::CudaUnavailable(_)), "{e}");
            assert!(e.to_string().starts_with("cuda is not available: "), "{e}");
        }
    }
    let err = Device::get(4096).unwrap_err();
    assert!(matches!(err, Error::CudaUnavailable(_)), "{err}");
    assert!(Device::by_uuid(&[0xee; 16]).is_err());
}

#[test]
fn keeping_the_current_context_without_a_driver_only_runs_the_closure() {
    assert_eq!(cuda_mp::keeping_current_context(|| 7), 7);
}
