//! 10: an async server in front of a pool of worker processes. Requests arrive as tokio tasks,
//! each with a host tensor; the server hands each to a worker process over that worker's own
//! channel (a send never waits for the worker, so it is fine inside async code), and one task per
//! worker receives the replies with `recv_async`, without a blocking thread, and routes each to
//! the request waiting for it. A worker doubles the tensor in place (the request's own shared
//! memory, nothing copied) and replies with its sum. Runs without a GPU.
//!
//!     cargo run --release --example 10_async_server

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::{Outcome, TIMEOUT};
use cuda_mp::{HostTensor, JoinHandle, Receiver, Sender, channel, spawn};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

const WORKERS: usize = 3;
const REQUESTS: usize = 60;

#[derive(Serialize, Deserialize)]
struct Request {
    id: u64,
    data: HostTensor<f32>,
}

#[derive(Serialize, Deserialize)]
struct Reply {
    id: u64,
    sum: f64,
    worker: u32,
}

/// A worker process: doubles every request's tensor in place and replies with its sum.
fn worker((requests, replies): (Receiver<Request>, Sender<Reply>)) {
    for Request { id, data } in &requests {
        data.map_inplace(|x| 2.0 * x);
        let sum = data.to_vec().iter().map(|&x| x as f64).sum();
        if replies.send(Reply { id, sum, worker: std::process::id() }).is_err() {
            break;
        }
    }
}

/// Requests waiting for their reply, by id.
type Waiting = Arc<Mutex<HashMap<u64, oneshot::Sender<Reply>>>>;

/// What tasks return: their errors cross threads, so they are text.
type TaskResult<T> = Result<T, String>;

/// The server: where requests go, and who waits for which reply.
struct Server {
    workers: Vec<Sender<Request>>,
    waiting: Waiting,
}

impl Server {
    /// Sends a request to a worker and waits for its reply.
    async fn serve(&self, id: u64, data: HostTensor<f32>) -> TaskResult<Reply> {
        let (done, reply) = oneshot::channel();
        self.waiting.lock().map_err(|_| "the table of waiting requests is poisoned")?.insert(id, done);
        self.workers[id as usize % self.workers.len()].send(Request { id, data }).map_err(|e| e.to_string())?;
        match tokio::time::timeout(TIMEOUT, reply).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => Err(format!("request {id}: its reply was lost")),
            Err(_) => Err(format!("request {id}: no reply within {TIMEOUT:?}")),
        }
    }
}

/// Receives one worker's replies and hands each to the request waiting for it, until the
/// worker is gone.
async fn route(replies: Receiver<Reply>, waiting: Waiting) -> TaskResult<usize> {
    let mut routed = 0;
    loop {
        let reply = match replies.recv_async().await {
            Ok(reply) => reply,
            Err(e) if e.is_disconnected() => return Ok(routed),
            Err(e) => return Err(e.to_string()),
        };
        let done = waiting.lock().map_err(|_| "the table of waiting requests is poisoned")?.remove(&reply.id);
        done.ok_or_else(|| format!("a reply to request {} that nobody waits for", reply.id))?
            .send(reply)
            .map_err(|_| "a request stopped waiting for its reply")?;
        routed += 1;
    }
}

async fn run_server(children: &mut Vec<JoinHandle<()>>) -> Outcome {
    let waiting: Waiting = Arc::default();
    let mut workers = Vec::new();
    let mut routers = Vec::new();
    for _ in 0..WORKERS {
        let (request_tx, request_rx) = channel()?;
        let (reply_tx, reply_rx) = channel()?;
        children.push(spawn((request_rx, reply_tx), worker));
        workers.push(request_tx);
        routers.push(tokio::spawn(route(reply_rx, waiting.clone())));
    }
    let server = Arc::new(Server { workers, waiting });

    // Every request is a task of its own, all in flight at once.
    let mut requests = Vec::new();
    for id in 0..REQUESTS as u64 {
        let server = server.clone();
        requests.push(tokio::spawn(async move {
            let values = common::random_values(1024);
            let data = HostTensor::from_vec(&[32, 32], values.clone()).map_err(|e| e.to_string())?;
            let reply = server.serve(id, data.clone()).await?;
            TaskResult::Ok((id, values, data, reply))
        }));
    }
    let mut served_by: HashMap<u32, usize> = HashMap::new();
    for request in requests {
        let (id, values, data, reply) = request.await??;
        let doubled: Vec<f32> = values.iter().map(|x| 2.0 * x).collect();
        let expected: f64 = doubled.iter().map(|&x| x as f64).sum();
        common::ensure(reply.id == id, &format!("request {id} got the reply to {}", reply.id))?;
        common::ensure(data.to_vec() == doubled, &format!("request {id}: the tensor was not doubled in place"))?;
        common::ensure(
            (reply.sum - expected).abs() < 1e-2,
            &format!("request {id}: sum {} instead of {expected}", reply.sum),
        )?;
        *served_by.entry(reply.worker).or_default() += 1;
    }
    for (pid, n) in &served_by {
        println!("worker {pid}: {n} requests served and verified");
    }
    common::ensure(served_by.len() == WORKERS, "not every worker served requests")?;

    // Closing the request channels ends the workers, and with them the reply channels.
    drop(server);
    let mut routed = 0;
    for router in routers {
        routed += router.await??;
    }
    common::ensure(routed == REQUESTS, &format!("{routed} replies routed for {REQUESTS} requests"))
}

fn run() -> Outcome {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_time().build()?;
    let mut children = Vec::new();
    let served = runtime.block_on(run_server(&mut children));
    for mut child in children {
        child.join_timeout(TIMEOUT)?;
    }
    served
}

#[cuda_mp::main]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    common::verdict(run(), &format!("{REQUESTS} requests served by {WORKERS} worker processes, every reply verified"))
}
