//! Named connections between processes of one user only: a peer of another user, at either end,
//! is refused before anything of it is used (the kernel's record of the peer, `SO_PEERCRED`).

use std::time::Duration;

use cuda_mp::{channel, spawn, Error, Listener, Sender};

cuda_mp::enable_test_support!();

const WAIT: Duration = Duration::from_secs(20);
const NOBODY: u32 = 65534;

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Becomes user `nobody` (this process only).
fn become_nobody() {
    // SAFETY: plain system calls on this process's credentials; nothing else is touched.
    let ok =
        unsafe { libc::setgroups(0, std::ptr::null()) == 0 && libc::setgid(NOBODY) == 0 && libc::setuid(NOBODY) == 0 };
    assert!(ok, "cannot become user {NOBODY}: {}", std::io::Error::last_os_error());
}

/// A cuda-mp connection's first message, as any program could write it.
#[derive(serde::Serialize, serde::Deserialize)]
struct Hello {
    magic: [u8; 8],
    version: u32,
    gauge: Option<ipc_channel::ipc::IpcSharedMemory>,
}

/// As another user: connects to `name` and says a well-formed hello (no cuda-mp on this end,
/// whose own connect would refuse a listener of another user).
fn connect_as_nobody(name: String) -> bool {
    become_nobody();
    let hello =
        Hello { magic: *b"cuda-mp\0", version: 2, gauge: Some(ipc_channel::ipc::IpcSharedMemory::from_byte(0, 64)) };
    match ipc_channel::ipc::IpcSender::<Hello>::connect(name) {
        Ok(tx) => tx.send(hello).is_ok(),
        Err(_) => false,
    }
}

/// As another user: listens, says where, and waits for a word before exiting.
fn listen_as_nobody((names, done): (Sender<String>, cuda_mp::Receiver<()>)) {
    become_nobody();
    let listener = Listener::<u8>::bind().unwrap();
    names.send(listener.name().to_string()).unwrap();
    let _ = listener.accept_timeout(WAIT);
    let _ = done.recv_timeout(WAIT);
}

fn assert_refused(e: &Error, what: &str) {
    match e {
        Error::Io(io) => {
            assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied, "{what}: {io}");
            assert!(io.to_string().contains("refused"), "{what}: {io}");
        }
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_peer_of_this_user_connects() {
    let listener = Listener::<u8>::bind().unwrap();
    let tx = Sender::<u8>::connect(listener.name()).unwrap();
    let rx = listener.accept_timeout(WAIT).unwrap();
    tx.send(7).unwrap();
    assert_eq!(rx.recv_timeout(WAIT).unwrap(), 7);
}

#[test]
fn a_sender_of_another_user_is_refused_by_the_listener() {
    if !is_root() {
        eprintln!("only root can run a peer as another user: the cross-user half is not run");
        return;
    }
    let listener = Listener::<u8>::bind().unwrap();
    // The listener's socket lives in a directory only its user may enter, so another user
    // cannot even connect. Opened up here, as if the name were reachable by anyone: the
    // listener must still refuse the peer.
    use std::os::unix::fs::PermissionsExt;
    let socket = std::path::Path::new(listener.name());
    let open = |p: &std::path::Path, m| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    open(socket.parent().unwrap(), 0o755);
    open(socket, 0o777);
    let peer = spawn(listener.name().to_string(), connect_as_nobody);
    let e = listener.accept_timeout(WAIT).unwrap_err();
    assert_refused(&e, "a sender running as nobody");
    let _ = peer.join();
}

#[test]
fn a_listener_of_another_user_is_refused_by_the_sender() {
    if !is_root() {
        eprintln!("only root can run a peer as another user: the cross-user half is not run");
        return;
    }
    let (names_tx, names) = channel().unwrap();
    let (done, done_rx) = channel().unwrap();
    let peer = spawn((names_tx, done_rx), listen_as_nobody);
    let name: String = names.recv_timeout(WAIT).unwrap();
    let e = Sender::<u8>::connect(&name).unwrap_err();
    assert_refused(&e, "a listener running as nobody");
    done.send(()).unwrap();
    peer.join().unwrap();
}
