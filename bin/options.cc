#include "bin/options.h"

#include "serving/openai/http_request.h"

namespace specontext::cli {

void add_model_options(CLI::App& cmd, ModelArgs& args) {
  auto* model = cmd.add_option("--model,-m", args.model_path,
                               "model: llama2.c .bin, .gguf, or a Hugging Face directory");
  auto* synth = cmd.add_option("--synthetic", args.synthetic,
                               "random weights with the shapes of a named model (llama-3.2-1b, "
                               "llama-3.1-8b, qwen3-8b, toy): measures speed, not quality");
  model->excludes(synth);
  cmd.add_option("--layers", args.layers, "with --synthetic: cut the depth to N layers");
  cmd.add_option("--dtype", args.dtype,
                 "weights in memory: auto (f32 and bf16 as stored, GGUF Q8_0/Q4_0/Q4_K/Q5_K/Q6_K kept as "
                 "stored where the backend runs them (CPU), f16 and other block types converted to f32; "
                 "f32 for --synthetic), f32 (everything converted or dequantised to f32), or bf16 (to "
                 "bf16: half the memory of f32)")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}))
      ->capture_default_str();
  cmd.add_option("--weight-seed", args.weight_seed, "with --synthetic: seed of the random weights");
}

void add_engine_options(CLI::App& cmd, EngineArgs& a) {
  add_model_options(cmd, a.model);
  cmd.add_option("--tokenizer", a.tokenizer, "tokenizer file (default: found next to the model)");
  cmd.add_option("--page-size", a.page_size, "tokens per KV page")->check(CLI::PositiveNumber);
  cmd.add_option("--kv-dtype", a.kv_dtype,
                 "KV cache element type: f32, f16 or bf16 (attention computes in f32)")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  cmd.add_option("--prefill-chunk", a.prefill_chunk, "prompt tokens per forward")->check(CLI::PositiveNumber);
  cmd.add_option("--admission", a.admission,
                 "reserve: admit a request when its KV at its final length fits beside the others'; "
                 "preempt: admit when its prompt fits, and recompute the newest request when memory runs short")
      ->check(CLI::IsMember({"reserve", "preempt"}))
      ->capture_default_str();
  cmd.add_option("--preemption-mode", a.preemption_mode,
                 "what a preempted request's KV does (--admission preempt): swap: its whole pages go to the "
                 "prefix offload store (--prefix-offload / --prefix-offload-disk) and come back when it runs "
                 "again; recompute: dropped and computed again (also swap's fallback without a store)")
      ->check(CLI::IsMember({"swap", "recompute"}))
      ->capture_default_str();
  cmd.add_flag("--prefix-caching,!--no-prefix-caching", a.prefix_caching,
               "start each request from the longest cached prefix of its prompt (running or finished "
               "requests' KV, in whole pages; finished ones stay cached until memory is wanted)")
      ->capture_default_str();
  cmd.add_option("--prefix-offload", a.prefix_offload,
                 "host memory (SIZE, e.g. 4GiB) that keeps cached prefixes evicted for room, KV of every layer; "
                 "a request whose prompt starts with one has it written back instead of recomputed (0: off; "
                 "needs prefix caching)")
      ->capture_default_str();
  cmd.add_option("--prefix-offload-disk", a.prefix_disk,
                 "disk space (SIZE) for offloaded prefixes that host memory lets go or cannot hold, read back "
                 "when a request wants one (0: off; needs prefix caching)")
      ->capture_default_str();
  cmd.add_option("--prefix-offload-dir", a.prefix_disk_dir,
                 "directory under which the prefix files go, in a directory of their own removed at exit "
                 "unless --prefix-offload-persist (default: the system's temporary directory)");
  cmd.add_flag("--prefix-offload-persist", a.prefix_disk_persist,
               "keep the prefix files across restarts: in DIR/specontext-<model and KV layout hash>, locked "
               "while this process runs; the cached prefixes are written there at exit and found by the next "
               "run (needs --prefix-offload-disk and --prefix-offload-dir)");
  cmd.add_option("--prefix-offload-remote", a.prefix_remote,
                 "KV node memory for offloaded prefixes instead of disk: SIZE@HOST:PORT[+HOST:PORT...] (a "
                 "`specontext kv-node`; mirrored on each endpoint, reads fail over; --kv-node-timeout-ms and "
                 "--kv-node-mode apply; needs prefix caching)");
  cmd.add_option(
      "--prefix-store", a.prefix_store,
      "a prefix store other servers share: redis://[USER@]HOST:PORT[/DB] (Redis or Valkey, "
      "standalone; cluster mode is refused). Each finished prompt's whole pages are written there "
      "in chunks (--prefix-store-chunk), each under a key of the model, KV layout and tokens, the "
      "chunks it holds already skipped; a prompt no local cache serves as far reads the longest run "
      "of chunks found back instead of computing it. The server evicts (run it with "
      "maxmemory-policy allkeys-lru); an unreachable store costs the computation only (needs prefix "
      "caching)");
  cmd.add_option("--prefix-store-password-file", a.prefix_store_password_file,
                 "file whose first line is the store's password (AUTH; USER@ in the URL for an ACL user; "
                 "others must not be able to read it); default: the SPECONTEXT_PREFIX_STORE_PASSWORD "
                 "environment variable; none: no AUTH. Never in the URL");
  cmd.add_option("--prefix-store-ttl", a.prefix_store_ttl_s,
                 "seconds a prefix written to --prefix-store lives (EX)")
      ->capture_default_str();
  cmd.add_option("--prefix-store-timeout-ms", a.prefix_store_timeout_ms,
                 "connect and command timeout of --prefix-store; after a failure it is not tried again for "
                 "250 ms, doubling to 10 s")
      ->capture_default_str();
  cmd.add_option("--prefix-store-max-value", a.prefix_store_max_value,
                 "largest prefix (SIZE) written to or read from --prefix-store; longer prompts are not shared "
                 "(Redis's proto-max-bulk-len is 512MB by default)")
      ->capture_default_str();
  cmd.add_option("--prefix-store-chunk", a.prefix_store_chunk,
                 "tokens of one chunk in --prefix-store (rounded up to whole KV pages): a prompt is written "
                 "as chunks, each under a key of every token up to its end, and only the chunks the store "
                 "does not hold are written; a later prompt reads the run of chunks from its first token")
      ->capture_default_str();
  cmd.add_option("--lost-tier", a.lost_tier,
                 "when a remote KV tier is lost for good (every replica of a --kv-node tier died): recompute "
                 "every request without it, or fail the requests of that step")
      ->check(CLI::IsMember({"recompute", "fail"}))
      ->capture_default_str();
  cmd.add_option("--max-context", a.max_context, "context limit per sequence (default: the model's)");
  cmd.add_option("--threads", a.threads, "CPU threads (0 = all cores of the NUMA node)");
  cmd.add_flag("--reference", a.reference, "use the naive reference kernels (slow; for checking)");
  cmd.add_option("--sparse", a.sparse,
                 "decode attention: specontext (default when a retrieval head is found), dense, "
                 "streaming, quest, oracle")
      ->check(CLI::IsMember({"dense", "specontext", "streaming", "quest", "oracle"}));
  cmd.add_option("--head", a.head_path, "retrieval head (EAGLE-3 layout safetensors)");
  cmd.add_option("--budget,-B", a.budget, "tokens attended per KV head in sparse decode")
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--sinks", a.sinks, "first tokens always attended")->check(CLI::NonNegativeNumber);
  cmd.add_option("--window", a.window, "most recent tokens always attended")->check(CLI::PositiveNumber);
  cmd.add_option("--backend", a.backend, "cpu, or cuda (falls back to cpu when no CUDA device is present)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  add_tier_options(cmd, a.tiers);
}

void add_tier_options(CLI::App& cmd, TierArgs& a) {
  cmd.add_option("--device-kv", a.device_kv,
                 "device memory for KV pages, working sets and the head's keys (e.g. 512MiB; default: all fits)");
  cmd.add_option("--host-kv", a.host_kv, "host KV pools, one per NUMA node (SIZE[,SIZE...]); enables offloading");
  cmd.add_option("--remote-kv", a.remote_kv, "remote KV nodes (in-process loopback), SIZE[,SIZE...]");
  cmd.add_option("--kv-node", a.kv_nodes,
                 "a remote tier on KV node processes over UCX: SIZE@HOST:PORT[+HOST:PORT...] (mirrored on "
                 "each endpoint; repeat for more tiers)");
  cmd.add_option("--kv-node-timeout-ms", a.kv_node_timeout_ms,
                 "control-plane calls, and RMA silence after which a KV node is declared dead")
      ->check(CLI::PositiveNumber);
  cmd.add_option("--kv-node-mode", a.kv_node_mode,
                 "gather: the node packs each batch of rows into one reply (few round trips; for TCP); "
                 "rma: one-sided get/put per row range (refused: KV nodes hand out no RMA keys, since UCX "
                 "lets one reach beyond its region)")
      ->check(CLI::IsMember({"gather", "rma"}));
  cmd.add_option("--kv-node-rejoin-ms", a.kv_node_rejoin_ms,
                 "a mirrored tier's dead replica is reconnected this often (its node restarted at the same "
                 "address) and, between steps, filled from a live replica and used again (0: never)")
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--kv-node-spare", a.kv_node_spares,
                 "HOST:PORT of a KV node that takes over a dead replica whose own node does not come back "
                 "(repeatable; tried in order)");
  cmd.add_option(
      "--kv-secret-file", a.kv_secret_file,
      "file holding the KV nodes' shared secret (owner-readable only), answered at each node's "
      "hello (default: the SPECONTEXT_KV_SECRET environment variable; none: nodes without a secret)");
  cmd.add_option("--kv-client-id", a.kv_client_id,
                 "this engine's client ID in the KV nodes' keys file (kv-node --keys-file); its secret is "
                 "--kv-secret-file's (default: SPECONTEXT_KV_CLIENT_ID; none: the nodes' shared secret)");
  cmd.add_option("--kv-node-tls-ca", a.kv_node_tls_ca,
                 "PEM CA certificate(s): talk TLS 1.2+ to the KV nodes (--kv-node, --prefix-offload-remote) and "
                 "accept only a node whose certificate they sign, for the HOST of its HOST:PORT (nodes started "
                 "with --tls-cert and --tls-key)");
  cmd.add_option("--remote-latency-us", a.remote_latency_us, "loopback link latency per transfer")
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--placement", a.placement,
                 "dynamic: re-plan before every step (layers leave and come back with hysteresis); "
                 "static: plan once for the final lengths")
      ->check(CLI::IsMember({"dynamic", "static"}));
  cmd.add_flag("!--no-cpu-filter", a.cpu_filter, "never switch CPU candidate filtering on");
  cmd.add_option("--shortlist", a.shortlist, "candidates per KV head with CPU filtering (0 = 4 x budget)")
      ->check(CLI::NonNegativeNumber);
  cmd.add_flag("!--no-probe", a.probe, "skip the start-up bandwidth probe");
  cmd.add_option("--staging-layers", a.staging_layers,
                 "remote layers whose whole KV is staged on the device at once, for dense attention and "
                 "per-layer selections (the next is loaded while one computes; 1 = no overlap)")
      ->check(CLI::PositiveNumber);
}

void add_api_key_options(CLI::App& cmd, ApiKeyArgs& args, const std::string& help) {
  cmd.add_option("--api-key-file", args.file,
                 "file of the keys clients must send as 'Authorization: Bearer KEY' on /v1/ (one per line, "
                 "chmod 600; else SPECONTEXT_API_KEY); " + help);
  // vLLM's --api-key KEY puts the key where every local user reads it: named here only to refuse it.
  cmd.add_option("--api-key", args.inline_keys)->group("");
}

Result<std::vector<std::string>> api_keys_of(const ApiKeyArgs& args) {
  if (!args.inline_keys.empty()) {
    return invalid_argument(
        "--api-key: a key on the command line is visible to every local user (ps, /proc/PID/cmdline); "
        "put the keys in a file readable by you only (chmod 600) and pass --api-key-file FILE, or set "
        "SPECONTEXT_API_KEY");
  }
  return cluster::load_api_keys(args.file);
}

}  // namespace specontext::cli
