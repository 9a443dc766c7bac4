//! Prints the prefill/decode split decisions the router makes against prompt length and link
//! rate (docs/router.md section 7): `cargo run -p kvrouter --example split_table [BYTES_PER_TOKEN
//! PREFILL_TOKENS_PER_S]`. Each cell is the router's own [`kvrouter_core::split::decide`] on an
//! idle prefill worker on another node, an idle decode worker holding none of the prompt, and
//! measured link and prefill rates; it shows the handoff estimate against the prefill saved.

use kvrouter_core::config::SplitConfig;
use kvrouter_core::split::{decision_table, table_markdown};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let prompts = [256, 1024, 4096, 16_384, 65_536, 131_072];
    let links = [1.0, 10.0, 25.0, 100.0, 400.0];
    let cfg = SplitConfig::default();
    let mut cases: Vec<(String, u64, f64)> = vec![
        ("Llama-3-8B, bf16 KV (128 KiB a token), engines prefilling 20k tokens/s".into(), 128 << 10, 20_000.0),
        ("Llama-3-70B, bf16 KV with GQA (320 KiB a token), engines prefilling 4k tokens/s".into(), 320 << 10, 4_000.0),
        ("the cross-node test's layout (1 KiB a token), engines reporting 100k tokens/s".into(), 1 << 10, 100_000.0),
    ];
    if let [b, r] = args.as_slice() {
        match (b.parse(), r.parse()) {
            (Ok(b), Ok(r)) => cases = vec![(format!("{b} bytes a token, {r} tokens/s"), b, r)],
            _ => {
                eprintln!("usage: split_table [BYTES_PER_TOKEN PREFILL_TOKENS_PER_S]");
                std::process::exit(2);
            }
        }
    }
    println!(
        "cross-node latency {} ms, min gain {} ms; cell: decision (handoff vs prefill saved)\n",
        cfg.cross_node_latency_ms, cfg.min_gain_ms
    );
    for (what, bytes_per_token, rate) in cases {
        println!("{what}:\n");
        let cells = decision_table(&cfg, bytes_per_token, 16, rate, &prompts, &links);
        println!("{}", table_markdown(&cells, &links));
    }
}
