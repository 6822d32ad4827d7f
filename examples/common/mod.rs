//! What the examples share: the verdict line, options, the GPU check, a timeout and test data.
//! Each example includes it with `mod common;`.

// Each example uses only some of these.
#![allow(dead_code)]

use std::error::Error;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;
use std::time::Duration;

#[cfg(feature = "cuda")]
use cuda_mp::Device;

mod llama;
#[allow(unused_imports)] // only the weight-publishing examples use it
pub use llama::llama7b_shapes;

/// What `run` functions return: `?` turns any error into the reason the example fails with.
pub type Outcome<T = ()> = Result<T, Box<dyn Error>>;

/// How long an example waits for another process before it fails instead of hanging.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// Prints `PASS: <pass>` when the example worked, and gives `main` its result: an error makes
/// the program print `Error: <reason>` to stderr, once, and exit with status 1.
pub fn verdict(outcome: Outcome, pass: &str) -> Outcome {
    match outcome {
        Ok(()) => {
            println!("PASS: {pass}");
            Ok(())
        }
        Err(e) => Err(Box::new(Failed(e.to_string()))),
    }
}

/// A failure's reason; `main` returning it prints `Error: <reason>` (its Debug) to stderr.
struct Failed(String);

impl fmt::Debug for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Error for Failed {}

/// Fails with `reason` unless `ok`.
pub fn ensure(ok: bool, reason: &str) -> Outcome {
    if ok { Ok(()) } else { Err(reason.into()) }
}

/// The value after `--name` on the command line, or `default` when it is not given.
pub fn arg<T>(name: &str, default: T) -> Outcome<T>
where
    T: FromStr,
    T::Err: Error + 'static,
{
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => {
            let value = args.get(i + 1).ok_or_else(|| format!("{name} needs a value"))?;
            value.parse().map_err(|e| format!("{name} {value}: {e}").into())
        }
    }
}

/// Fails at once, saying why, where no CUDA GPU is usable; otherwise returns how many are visible.
pub fn require_gpu() -> Outcome<usize> {
    #[cfg(feature = "cuda")]
    let why = match Device::count() {
        Ok(n) if n > 0 => return Ok(n),
        Ok(_) => "no GPU is visible".to_string(),
        Err(e) => e.to_string(),
    };
    #[cfg(not(feature = "cuda"))]
    let why = "cuda-mp was built without its cuda feature".to_string();
    Err(format!(
        "this example needs a CUDA GPU ({why}); without one, run 01_queue_handoff, 10_async_server, \
         11_host_pipe, 12_host_listener or 13_host_pool"
    )
    .into())
}

/// The `main` of a two-program example: runs the side that `--mode` names, `receiver`,
/// `sender` or `both` (the default: the receiver as a separate program started from here, the
/// sender here). The receiver publishes its name to the file `--name-file`, where the sender
/// finds it. The verdict is the sender's.
pub fn receiver_or_sender(
    needs_gpu: bool,
    receiver: fn(&Path) -> Outcome,
    sender: fn(&Path) -> Outcome,
    pass: &str,
) -> Outcome {
    // `--mode` without a value falls through to the unknown-mode failure.
    let mode: String = arg("--mode", "both".into()).unwrap_or_default();
    let outcome = (|| {
        let program = std::env::current_exe()?;
        let stem = program.file_stem().unwrap_or_default().to_string_lossy();
        let name_file: PathBuf = arg("--name-file", std::env::temp_dir().join(format!("cuda_mp_{stem}.name")))?;
        if needs_gpu {
            // Before listening or connecting: without a GPU the other side would wait in vain.
            require_gpu()?;
        }
        match mode.as_str() {
            "receiver" => receiver(&name_file),
            "sender" => sender(&name_file),
            "both" => with_receiver_program(&program, &name_file, || sender(&name_file)),
            other => Err(format!("unknown --mode {other:?}: use receiver, sender or both").into()),
        }
    })();
    if mode == "receiver" && outcome.is_ok() {
        // Only the sender can tell whether the receiver's work arrived.
        println!("receiver: done");
        return Ok(());
    }
    verdict(outcome, pass)
}

/// Starts `program` as the receiver and runs `sender` here.
fn with_receiver_program(program: &Path, name_file: &Path, sender: impl FnOnce() -> Outcome) -> Outcome {
    // A name left by an earlier run would point the sender at a receiver that is gone.
    let _ = std::fs::remove_file(name_file);
    let mut receiver = Command::new(program).args(["--mode", "receiver", "--name-file"]).arg(name_file).spawn()?;
    let sent = sender();
    if sent.is_err() {
        // Otherwise it would wait for a sender that is not coming.
        let _ = receiver.kill();
    }
    let status = receiver.wait()?;
    sent?;
    ensure(status.success(), &format!("the receiver program failed ({status})"))
}

/// `n` pseudo-random numbers in [0, 1), seeded by the clock.
pub fn random_values(n: usize) -> Vec<f32> {
    let mut s =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
            | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect()
}

/// A Python program started by an example, with its standard output read line by line.
pub struct PythonPeer {
    child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl PythonPeer {
    /// Starts `python3 <script> <args>` (the script's path relative to the repository root),
    /// with this repository's `python/` package importable unless `PYTHONPATH` already says
    /// where `cuda_mp` is.
    pub fn start(script: &str, args: &[&str]) -> Outcome<PythonPeer> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let path = if root.join(script).exists() { root.join(script) } else { PathBuf::from(script) };
        let mut cmd = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()));
        cmd.arg(&path).args(args).stdout(std::process::Stdio::piped());
        if std::env::var_os("PYTHONPATH").is_none() {
            cmd.env("PYTHONPATH", root.join("python"));
        }
        let mut child = cmd.spawn().map_err(|e| format!("cannot start python3 {}: {e}", path.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        Ok(PythonPeer { child, lines: std::io::BufRead::lines(std::io::BufReader::new(stdout)) })
    }

    /// The rest of the first line that starts with `prefix` (lines before it are echoed).
    pub fn line_after(&mut self, prefix: &str) -> Outcome<String> {
        for line in self.lines.by_ref() {
            let line = line?;
            match line.strip_prefix(prefix) {
                Some(rest) => return Ok(rest.trim().to_string()),
                None => println!("python: {line}"),
            }
        }
        Err(format!("python exited before printing {prefix:?}").into())
    }

    /// Echoes the rest of the output and waits for the program; fails unless it exited with 0.
    pub fn finish(mut self) -> Outcome {
        for line in self.lines.by_ref() {
            println!("python: {}", line?);
        }
        let status = self.child.wait()?;
        ensure(status.success(), &format!("the python program ended with {status}"))
    }
}

impl Drop for PythonPeer {
    fn drop(&mut self) {
        // A peer left running after a failure would wait for ever on its channels.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
