//! Operating-system calls made through `rustix` (safe wrappers, descriptors as `OwnedFd` /
//! `BorrowedFd`): the layer the rest of the crate's system calls move into. Now: messages with
//! descriptors on Unix sockets, and who is at a socket's other end (`uds.rs`).

mod uds;

pub(crate) use uds::{check_peer_is_this_user, recv_with_fds, send_with_fds};
