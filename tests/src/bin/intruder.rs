//! A hostile local client for the security tests, run as another uid: it tries what an engine
//! of another user must not be able to do to someone else's engine, or to everyone else.
//!
//! ```text
//! intruder SOCKET use ENGINE_ID        # heartbeat, load into, wait on, unregister, look up (LOOKUP) another's engine
//! intruder SOCKET register N           # register N engines of its own (memfd KV memory)
//! intruder SOCKET share PATH N         # register N engines over the KV file at PATH (opened
//!                                       # for writing), holding them until it exits
//! intruder SOCKET hold N SECS          # open N connections and hold them
//! intruder SOCKET tenant SALT SAVE LOOKUP  # an engine salted SALT ("-": none) saves the first SAVE
//!                                       # blocks of tenant_prompt(8), then looks up LOOKUP of them
//! intruder SOCKET probe-salt SALT HOW      # a Register naming SALT that fails anyway (HOW: no-region,
//!                                       # bad-ticket): prints its code and message
//! ```
//! Prints one line `key=value ...` of gRPC codes (or counts) and exits 0 when it could run.

use std::process::ExitCode;
use std::time::Duration;

use kvproto::pb;
use kvproto::{Dtype, KvLayout, LayoutKind, Namespace};

fn code(r: Result<tonic::Response<impl Sized>, tonic::Status>) -> String {
    match r {
        Ok(_) => "Ok".into(),
        Err(s) => format!("{:?}", s.code()),
    }
}

async fn raw(socket: String) -> Result<pb::kvcached_client::KvcachedClient<tonic::transport::Channel>, String> {
    let ch = tonic::transport::Endpoint::try_from("http://kvcached.local")
        .map_err(|e| e.to_string())?
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { tokio::net::UnixStream::connect(socket).await.map(hyper_util::rt::TokioIo::new) }
        }))
        .await
        .map_err(|e| e.to_string())?;
    Ok(pb::kvcached_client::KvcachedClient::new(ch))
}

async fn run(args: &[String]) -> Result<String, String> {
    let socket = args.first().ok_or("usage: intruder SOCKET use|register|hold ...")?.clone();
    match args.get(1).map(String::as_str) {
        Some("use") => {
            let id: u64 = args.get(2).and_then(|a| a.parse().ok()).ok_or("use ENGINE_ID")?;
            let mut c = raw(socket.clone()).await?;
            let hb = code(c.heartbeat(pb::EngineRef { engine_id: id }).await);
            let tokens = kvproto::tokens_to_le(&[1u32; 16]);
            let load = code(
                c.load(pb::LoadRequest { engine_id: id, tokens, block_ids: vec![0], wait: true, ..Default::default() })
                    .await,
            );
            let wait = code(c.wait(pb::WaitRequest { engine_id: id, op_id: 1, timeout_ms: 0, until_blocks: 0 }).await);
            let unreg = code(c.unregister(pb::EngineRef { engine_id: id }).await);
            let ask =
                pb::LookupRequest { engine_id: id, tokens: kvproto::tokens_to_le(&[1u32; 16]), ..Default::default() };
            let mut l = kvtests::lookup_raw::open(std::path::Path::new(&socket)).await.map_err(|e| e.to_string())?;
            let lookup = match kvtests::lookup_raw::ask(&mut l, &ask).await.map_err(|e| e.to_string())? {
                Ok(_) => "Ok".to_string(),
                Err(r) => format!("{:?}", tonic::Code::from_i32(r.code)),
            };
            Ok(format!("heartbeat={hb} load={load} wait={wait} unregister={unreg} lookup={lookup}"))
        }
        Some("register") => {
            let n: u32 = args.get(2).and_then(|a| a.parse().ok()).ok_or("register N")?;
            let layout = KvLayout {
                num_layers: 1,
                kv_heads: 1,
                head_dim: 64,
                dtype: Dtype::Bf16,
                tokens_per_block: 16,
                kind: LayoutKind::Contiguous,
            };
            let mut ok = 0;
            let mut first_err = String::from("none");
            let mut held = Vec::new();
            for i in 0..n {
                let mem = kvclient::KvMemory::anonymous(&layout, 4).map_err(|e| e.to_string())?;
                let mut c = kvclient::Client::connect(&socket).await.map_err(|e| e.to_string())?;
                c.set_token_area_bytes(0);
                match c.register(&format!("intruder-{i}"), &Namespace::new("m", layout), &mem).await {
                    Ok(_) => ok += 1,
                    Err(e) if first_err == "none" => first_err = e.to_string().replace(' ', "_"),
                    Err(_) => {}
                }
                held.push((c, mem));
            }
            Ok(format!("registered={ok} first_error={first_err}"))
        }
        Some("share") => {
            let path = args.get(2).ok_or("share PATH N")?;
            let n: u32 = args.get(3).and_then(|a| a.parse().ok()).ok_or("share PATH N")?;
            let layout = kvtests::tenant_layout();
            let slots = kvproto::slots::SlotLayout::layer_separate(&layout, 8);
            let mut ok = 0;
            let mut first_err = String::from("none");
            let mut held = Vec::new();
            for i in 0..n {
                let file = std::fs::OpenOptions::new().read(true).write(true).open(path).map_err(|e| e.to_string())?;
                let mem = kvclient::KvMemory::from_file(file, slots.clone()).map_err(|e| e.to_string())?;
                let mut c = kvclient::Client::connect(&socket).await.map_err(|e| e.to_string())?;
                c.set_token_area_bytes(0);
                match c.register(&format!("sharer-{i}"), &Namespace::new(format!("nobody/g{i}"), layout), &mem).await {
                    Ok(_) => ok += 1,
                    Err(e) if first_err == "none" => first_err = e.to_string().replace(' ', "_"),
                    Err(_) => {}
                }
                held.push((c, mem));
            }
            Ok(format!("registered={ok} first_error={first_err}"))
        }
        Some("hold") => {
            let n: usize = args.get(2).and_then(|a| a.parse().ok()).ok_or("hold N SECS")?;
            let secs: u64 = args.get(3).and_then(|a| a.parse().ok()).ok_or("hold N SECS")?;
            let mut open = Vec::new();
            for _ in 0..n {
                if let Ok(s) = tokio::net::UnixStream::connect(&socket).await {
                    open.push(s);
                }
            }
            println!("connected={}", open.len());
            tokio::time::sleep(Duration::from_secs(secs)).await;
            Ok(format!("held={}", open.len()))
        }
        Some("tenant") => {
            let (Some(salt), Some(save), Some(lookup)) = (
                args.get(2),
                args.get(3).and_then(|a| a.parse::<u32>().ok()),
                args.get(4).and_then(|a| a.parse::<u32>().ok()),
            ) else {
                return Err("tenant SALT SAVE LOOKUP".into());
            };
            let layout = kvtests::tenant_layout();
            let mut ns = Namespace::new("m", layout);
            ns.tenant_salt = (salt != "-").then(|| salt.as_bytes().to_vec());
            let mut mem = kvclient::KvMemory::anonymous(&layout, 8).map_err(|e| e.to_string())?;
            for b in 0..8 {
                mem.write_block(b, &kvclient::synthetic_block(9, b, layout.block_bytes() as usize));
            }
            let mut c = kvclient::Client::connect(&socket).await.map_err(|e| e.to_string())?;
            c.set_token_area_bytes(0);
            if let Err(e) = c.register("tenant", &ns, &mem).await {
                return Ok(format!("register={}", e.to_string().replace(' ', "_")));
            }
            let prompt = kvtests::tenant_prompt(8);
            let saved = if save > 0 {
                let slots: Vec<u32> = (0..save).collect();
                match c.save(&prompt[..16 * save as usize], 0, &slots).await {
                    Ok(r) => r.stored,
                    Err(kvclient::ClientError::Rpc(s)) => return Ok(format!("register=Ok save={:?}", s.code())),
                    Err(e) => return Err(e.to_string()),
                }
            } else {
                0
            };
            let matched = c.lookup(&prompt[..16 * lookup as usize]).await.map_err(|e| e.to_string())?.matched_blocks;
            Ok(format!("register=Ok saved={saved} matched={matched}"))
        }
        Some("probe-salt") => {
            let (Some(salt), Some(how)) = (args.get(2), args.get(3)) else {
                return Err("probe-salt SALT no-region|bad-ticket".into());
            };
            let layout = kvtests::tenant_layout();
            let mut ns = Namespace::new("m", layout);
            ns.tenant_salt = Some(salt.as_bytes().to_vec());
            let seg = layout.segment_bytes();
            let region = (how == "bad-ticket").then(|| pb::MemoryRegion {
                kind: Some(pb::memory_region::Kind::FdTicket(vec![7; 32])),
                size_bytes: 8 * layout.block_bytes(),
                cuda_device: 0,
            });
            let n = kvproto::slots::SlotLayout::for_layout(&layout, 8);
            let req = pb::RegisterRequest {
                engine_name: "probe".into(),
                namespace: Some(pb::NamespaceSpec::from(&ns)),
                region,
                segments: n.segments.iter().map(|s| pb::Segment { offset: s.offset, block_stride: s.stride }).collect(),
                segment_bytes: seg,
                num_blocks: 8,
                ..Default::default()
            };
            let mut c = raw(socket).await?;
            Ok(match c.register(req).await {
                Ok(_) => "code=Ok".into(),
                Err(s) => format!("code={:?} message={}", s.code(), s.message().replace(' ', "_")),
            })
        }
        _ => Err("usage: intruder SOCKET use|register|hold|tenant|probe-salt ...".into()),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args).await {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("intruder: {e}");
            ExitCode::FAILURE
        }
    }
}
