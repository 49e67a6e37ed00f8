// The specontext binary end to end: JSON summary keys, streamed text, error messages and exit
// codes for bad input.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/base/utf8.h"
#include "core/model/synthetic.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

using testing::repo_path;

struct CliRun {
  int exit_code = -1;
  std::string out;  // stdout and stderr, merged when merge_stderr
};

CliRun run_cli(const std::string& args, bool merge_stderr = true) {
  const std::string cmd = std::string(SPECONTEXT_BIN) + " " + args + (merge_stderr ? " 2>&1" : " 2>/dev/null");
  CliRun r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

TEST(Cli, GenerateJsonSummaryHasTheKeysAndMatchesGreedyGolden) {
  const CliRun ok = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                         " --prompt 'Once upon a time' -n 40 --json",
                     false);
  ASSERT_EQ(ok.exit_code, 0) << ok.out;
  const auto j = nlohmann::json::parse(ok.out);
  for (const char* key : {"prompt_tokens", "generated_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "kv_bytes"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["prompt_tokens"].get<int>(), 5);  // BOS + 4 pieces
  EXPECT_EQ(j["generated_tokens"].get<int>(), 40);
  EXPECT_GT(j["decode_tokens_per_s"].get<double>(), 0.0);
  // 44 cached tokens (the last sampled token is never fed back) in 16-token pages of 1280 B/token
  EXPECT_EQ(j["kv_bytes"].get<int64_t>(), 3 * 16 * 1280);
  // Greedy: the golden continuation of "Once upon a time" begins like llama2.c's.
  EXPECT_EQ(j["text"].get<std::string>().rfind(", there was a little girl named Lily.", 0), 0u) << j["text"];
}

// At temperature 50 stories260K samples its byte-fallback tokens (<0x80>...) freely, so the text is
// not valid UTF-8. Before, --json aborted in nlohmann's dump (type_error 316, exit 134); now the
// JSON carries the text with each invalid sequence as U+FFFD, as the streamed bytes decode.
TEST(Cli, GenerateJsonReplacesInvalidUtf8InsteadOfAborting) {
  const std::string args = "generate --model " + repo_path("models/stories260K/stories260K.bin") +
                           " --prompt 'Once' -n 40 --temperature 50 --seed 1";
  const CliRun streamed = run_cli(args, false);
  ASSERT_EQ(streamed.exit_code, 0) << streamed.out;
  ASSERT_FALSE(streamed.out.empty());
  const std::string raw = streamed.out.substr(0, streamed.out.size() - 1);  // less the final newline
  ASSERT_NE(sanitize_utf8(raw), raw) << "the run wrote valid UTF-8: nothing tested";
  const CliRun json_run = run_cli(args + " --json", false);
  ASSERT_EQ(json_run.exit_code, 0) << json_run.out;
  const auto j = nlohmann::json::parse(json_run.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << json_run.out;
  const std::string text = j["text"].get<std::string>();
  EXPECT_EQ(text, sanitize_utf8(raw));
  EXPECT_NE(text.find("\xEF\xBF\xBD"), std::string::npos);
}

// eval runs the task suite found beside the model (models/longctx/tasks.json) after the fidelity
// protocol; --no-tasks runs the fidelity protocol alone, and excludes --no-fidelity.
TEST(Cli, EvalNoTasksRunsOnlyTheFidelityProtocol) {
  const std::string args = "eval -m " + repo_path("models/longctx/hf") + " --text " +
                           repo_path("data/austen/persuasion.txt") +
                           " --context 256 --positions 2 --needles 0 --methods streaming --budgets 64"
                           " --task-lengths 256 --task-kinds kv --task-depths 0.5 --task-trials 1 --json -";
  for (const bool no_tasks : {false, true}) {
    SCOPED_TRACE(no_tasks ? "--no-tasks" : "default");
    const CliRun r = run_cli(args + (no_tasks ? " --no-tasks" : ""), false);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r.out;
    EXPECT_TRUE(j.contains("records"));
    EXPECT_EQ(j.contains("tasks"), !no_tasks);
  }
  const CliRun both = run_cli(args + " --no-tasks --no-fidelity");
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.out.find("--no-tasks"), std::string::npos) << both.out;
}

// --prefix-caching: a batch of the same prompt computes it once (the others wait for it and fork
// its pages), with the text of computing it alone; SpeContext forks the head's keys too.
TEST(Cli, PrefixCachingComputesABatchesSharedPromptOnce) {
  const std::string prompt =
      "'Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day'";
  std::string texts[2];
  int64_t cached[2] = {0, 0};
  for (int on = 0; on < 2; ++on) {
    const CliRun r = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                                 " --prompt " + prompt + " -n 30 --batch 3 --temperature 0 --json" +
                                 (on ? " --prefix-caching" : " --no-prefix-caching"),
                             false);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    texts[on] = j["text"].get<std::string>();
    cached[on] = j["cached_prompt_tokens"].get<int64_t>();
    EXPECT_EQ(j["sparse"], "specontext");
  }
  EXPECT_EQ(cached[0], 0);
  EXPECT_EQ(cached[1], 2 * 32) << "two of the three fork the 33-token prompt's 2 whole pages";
  EXPECT_EQ(texts[1], texts[0]);
}

// --prefix-offload: a size, and only with prefix caching; refused before anything runs.
TEST(Cli, PrefixOffloadNeedsPrefixCachingAndASize) {
  const std::string model = "generate --model " + repo_path("models/stories260K/stories260K.bin") + " -n 4";
  const CliRun ok = run_cli(model + " --prefix-caching --prefix-offload 1MiB --json", false);
  EXPECT_EQ(ok.exit_code, 0) << ok.out;
  const CliRun alone = run_cli(model + " --no-prefix-caching --prefix-offload 1MiB");
  EXPECT_NE(alone.exit_code, 0);
  EXPECT_NE(alone.out.find("--prefix-offload needs --prefix-caching"), std::string::npos) << alone.out;
  const CliRun bad = run_cli(model + " --prefix-caching --prefix-offload lots");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--prefix-offload"), std::string::npos) << bad.out;
  // The disk level: a size, prefix caching, and an existing directory.
  const CliRun disk = run_cli(model + " --prefix-caching --prefix-offload-disk 8MiB --prefix-offload-dir /tmp --json", false);
  EXPECT_EQ(disk.exit_code, 0) << disk.out;
  const CliRun disk_alone = run_cli(model + " --no-prefix-caching --prefix-offload-disk 8MiB");
  EXPECT_NE(disk_alone.out.find("--prefix-offload-disk needs --prefix-caching"), std::string::npos) << disk_alone.out;
  const CliRun dir_alone = run_cli(model + " --prefix-caching --prefix-offload-dir /tmp");
  EXPECT_NE(dir_alone.out.find("--prefix-offload-dir needs --prefix-offload-disk"), std::string::npos) << dir_alone.out;
  const CliRun no_dir = run_cli(model + " --prefix-caching --prefix-offload-disk 8MiB --prefix-offload-dir /nonexistent-dir");
  EXPECT_NE(no_dir.exit_code, 0);
  EXPECT_NE(no_dir.out.find("--prefix-offload-dir /nonexistent-dir is not a directory"), std::string::npos) << no_dir.out;
}

// --prefix-store: needs prefix caching; a password in the URL is refused without being repeated;
// the password file needs the store; a store nobody listens at is an error at start, named; a
// chunk under one token is refused before connecting.
// (The store itself, against a real redis-server: tests/cluster/redis_prefix_store_test.cc.)
TEST(Cli, PrefixStoreFlagsAreCheckedAtStart) {
  const std::string model = "generate --model " + repo_path("models/stories260K/stories260K.bin") + " -n 4";
  const CliRun alone = run_cli(model + " --no-prefix-caching --prefix-store redis://127.0.0.1:1");
  EXPECT_NE(alone.exit_code, 0);
  EXPECT_NE(alone.out.find("--prefix-store needs --prefix-caching"), std::string::npos) << alone.out;
  const CliRun secret = run_cli(model + " --prefix-caching --prefix-store redis://u:hunter2@127.0.0.1:1");
  EXPECT_NE(secret.exit_code, 0);
  EXPECT_NE(secret.out.find("password does not go in the URL"), std::string::npos) << secret.out;
  EXPECT_EQ(secret.out.find("hunter2"), std::string::npos) << secret.out;
  const CliRun file = run_cli(model + " --prefix-caching --prefix-store-password-file /nonexistent");
  EXPECT_NE(file.exit_code, 0);
  EXPECT_NE(file.out.find("--prefix-store-password-file needs --prefix-store"), std::string::npos) << file.out;
  const CliRun nobody = run_cli(model + " --prefix-caching --prefix-store redis://127.0.0.1:1");
  EXPECT_NE(nobody.exit_code, 0);
  EXPECT_NE(nobody.out.find("redis 127.0.0.1:1/0: cannot connect"), std::string::npos) << nobody.out;
  const CliRun no_chunk = run_cli(model + " --prefix-caching --prefix-store redis://127.0.0.1:1 --prefix-store-chunk 0");
  EXPECT_NE(no_chunk.exit_code, 0);
  EXPECT_NE(no_chunk.out.find("--prefix-store-chunk must be at least 1 token"), std::string::npos) << no_chunk.out;
}

// --prefix-offload-persist: the first run's cached prefix is written at its exit and the next
// run, whose prompt extends the first's prompt and text, takes it from the file; without a
// directory the flag is refused.
TEST(Cli, PersistentPrefixFilesCarryACacheFromOneRunToTheNext) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "cli-persist";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string model = "generate --model " + repo_path("models/stories260K/stories260K.bin") +
                            " --temperature 0 --prefix-caching --prefix-offload-disk 64MiB --json";
  const std::string persist = model + " --prefix-offload-persist --prefix-offload-dir " + dir.string();
  const std::string prompt =
      "Once upon a time, there was a little girl named Lily. She loved to play outside";
  const CliRun first = run_cli(persist + " -n 40 --prompt '" + prompt + "'", false);
  ASSERT_EQ(first.exit_code, 0) << first.out;
  const auto a = nlohmann::json::parse(first.out);
  EXPECT_EQ(a["prefix_disk"]["found"].get<int64_t>(), 0) << a.dump();
  EXPECT_EQ(a["prefix_disk"]["writes"].get<int64_t>(), 1) << a.dump();
  std::string text = a["text"].get<std::string>();
  // The same prompt again: the file holds more than the prompt, and the one sequence slot of
  // `generate` goes to it, cut to the prompt's whole pages; the longer prefix stays on disk.
  const CliRun again = run_cli(persist + " -n 40 --prompt '" + prompt + "'", false);
  ASSERT_EQ(again.exit_code, 0) << again.out;
  const auto c = nlohmann::json::parse(again.out);
  EXPECT_EQ(c["prefix_disk"]["restores"].get<int64_t>(), 1) << c.dump();
  const int64_t whole_pages = (c["prompt_tokens"].get<int64_t>() - 1) / 16 * 16;
  ASSERT_GT(whole_pages, 0);
  EXPECT_EQ(c["cached_prompt_tokens"].get<int64_t>(), whole_pages) << c.dump();
  EXPECT_EQ(c["text"].get<std::string>(), text);
  std::erase(text, '\'');
  const CliRun next = run_cli(persist + " -n 4 --prompt '" + prompt + text + " One day'", false);
  ASSERT_EQ(next.exit_code, 0) << next.out;
  const auto b = nlohmann::json::parse(next.out);
  EXPECT_EQ(b["prefix_disk"]["found"].get<int64_t>(), 1) << b.dump();
  EXPECT_EQ(b["prefix_disk"]["restores"].get<int64_t>(), 1) << b.dump();
  EXPECT_GE(b["cached_prompt_tokens"].get<int64_t>(), 48) << b.dump();
  const CliRun no_dir = run_cli(model + " -n 4 --prefix-offload-persist");
  EXPECT_NE(no_dir.exit_code, 0);
  EXPECT_NE(no_dir.out.find("--prefix-offload-persist needs --prefix-offload-dir"), std::string::npos)
      << no_dir.out;
  std::filesystem::remove_all(dir);
}

// --preemption-mode: on a pool too small for the batch, swap sends preempted requests' pages to
// the offload store and back (counted), recompute does not; the text is the same.
TEST(Cli, PreemptionModeSwapsPreemptedRequestsThroughTheOffloadStore) {
  const std::string run = "generate --model " + repo_path("models/stories260K/stories260K.bin") +
                          " --prompt 'Once upon a time' -n 200 --batch 4 --temperature 0.8 --seed 3"
                          " --device-kv 1MiB --host-kv 2MiB --admission preempt --prefix-caching"
                          " --prefix-offload 8MiB --json --preemption-mode ";
  std::string texts[2];
  for (int swap = 0; swap < 2; ++swap) {
    const CliRun r = run_cli(run + (swap ? "swap" : "recompute"), false);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    texts[swap] = j["text"].get<std::string>();
    EXPECT_GE(j["preemptions"].get<int64_t>(), 1) << j.dump();
    if (swap) {
      EXPECT_EQ(j["preemption_swaps"].get<int64_t>(), j["preemptions"].get<int64_t>()) << j.dump();
    } else {
      EXPECT_EQ(j["preemption_swaps"].get<int64_t>(), 0) << j.dump();
    }
  }
  EXPECT_EQ(texts[1], texts[0]);
  const CliRun bad = run_cli(run + "later");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--preemption-mode"), std::string::npos) << bad.out;
}

TEST(Cli, HalfPrecisionKvHalvesTheCacheAndKeepsTheGreedyText) {
  for (const char* dtype : {"bf16", "f16"}) {
    const CliRun r = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                                 " --prompt 'Once upon a time' -n 40 --json --kv-dtype " + dtype,
                             false);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["kv_dtype"].get<std::string>(), dtype);
    EXPECT_EQ(j["kv_bytes_per_token"].get<int64_t>(), 640);
    EXPECT_EQ(j["kv_bytes"].get<int64_t>(), 3 * 16 * 640);  // the f32 run above: 1280 B/token
    EXPECT_EQ(j["text"].get<std::string>().rfind(", there was a little girl named Lily.", 0), 0u) << j["text"];
  }
  const CliRun bad = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                             " --prompt hi --kv-dtype q8_0");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--kv-dtype"), std::string::npos) << bad.out;
}

TEST(Cli, GenerateStreamsTextAndPrintsSummaryToStderr) {
  const CliRun r = run_cli("generate --model " + repo_path("models/babyllama105/model5000.bin") +
                    " --prompt 'The cat' -n 20 --temperature 0.7 --seed 3");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("prompt tokens:"), std::string::npos);
  EXPECT_NE(r.out.find("decode:"), std::string::npos);
}

TEST(Cli, SyntheticModelDecodesAtSyntheticContext) {
  const CliRun r = run_cli("generate --synthetic toy --synthetic-context 1000 --batch 3 -n 4 --json", false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["generated_tokens"].get<int>(), 12);
  EXPECT_EQ(j["batch"].get<int>(), 3);
  EXPECT_GT(j["kv_bytes"].get<int64_t>(), 3 * 1000 * 2 * 2 * 32 * 4);
  const CliRun note = run_cli("generate --synthetic toy --synthetic-context 100 -n 2");
  EXPECT_NE(note.out.find("measures speed, not quality"), std::string::npos);
}

// --response-format json_object: the greedy text is the start of a JSON object (nlohmann stops
// only at the end of the input), where the free text is a story; a model without a tokenizer is
// a clear error.
TEST(Cli, ResponseFormatJsonObjectConstrainsTheText) {
  const CliRun r = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                               " --prompt 'Once upon a time' -n 60 --response-format json_object --json",
                           false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const std::string text = nlohmann::json::parse(r.out)["text"];
  ASSERT_NE(text.find('{'), std::string::npos) << text;
  EXPECT_EQ(text.find_first_not_of(" \n\t\r"), text.find('{')) << text;
  try {
    EXPECT_TRUE(nlohmann::json::parse(text).is_object()) << text;
  } catch (const nlohmann::json::parse_error& e) {
    EXPECT_EQ(e.byte, text.size() + 1) << e.what() << " in " << text;  // cut by -n, not broken
  }
  const CliRun bad = run_cli("generate --synthetic toy -n 2 --response-format json_object");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--response-format json_object needs the model's tokenizer"), std::string::npos) << bad.out;
  const CliRun unknown = run_cli("generate --synthetic toy -n 2 --response-format yaml");
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_NE(unknown.out.find("--response-format"), std::string::npos) << unknown.out;
}

// --json-schema FILE: the greedy text is a document valid against the file's schema, properties
// in the file's order; a bad file or a keyword outside the subset is a clear error naming it.
TEST(Cli, JsonSchemaFileConstrainsTheText) {
  const std::string dir = testing::temp_dir("spx-cli-schema");
  const std::string schema = dir + "/pet.json";
  testing::write_file(schema, R"({"type":"object","properties":{"pet":{"enum":["cat","dog"]},)"
                              R"("age":{"type":"integer"}},"required":["pet","age"],"additionalProperties":false})");
  const std::string model = "generate --model " + repo_path("models/stories260K/stories260K.bin") +
                            " --prompt 'Once upon a time' -n 60 --json";
  const CliRun r = run_cli(model + " --json-schema " + schema, false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const std::string text = nlohmann::json::parse(r.out)["text"];
  EXPECT_TRUE(text.starts_with(R"({"pet")")) << text;
  const auto doc = nlohmann::json::parse(text, nullptr, false);
  ASSERT_TRUE(doc.is_object()) << text;
  EXPECT_TRUE(doc["pet"] == "cat" || doc["pet"] == "dog") << text;
  EXPECT_TRUE(doc["age"].is_number_integer()) << text;
  EXPECT_EQ(doc.size(), 2u) << text;
  testing::write_file(dir + "/pattern.json", R"({"type":"string","pattern":"a+"})");
  const CliRun pattern = run_cli(model + " --json-schema " + dir + "/pattern.json");
  EXPECT_NE(pattern.exit_code, 0);
  EXPECT_NE(pattern.out.find("unsupported keyword 'pattern'"), std::string::npos) << pattern.out;
  testing::write_file(dir + "/broken.json", "{");
  const CliRun broken = run_cli(model + " --json-schema " + dir + "/broken.json");
  EXPECT_NE(broken.exit_code, 0);
  EXPECT_NE(broken.out.find("broken.json is not JSON"), std::string::npos) << broken.out;
  const CliRun missing = run_cli(model + " --json-schema " + dir + "/none.json");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.out.find("none.json"), std::string::npos) << missing.out;
}

TEST(Cli, BadInputGivesClearErrorsAndNonZeroExit) {
  const std::string dir = testing::temp_dir("spx-cli");
  // Missing file
  CliRun r = run_cli("generate --model /nonexistent/model.bin --prompt hi");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("/nonexistent/model.bin"), std::string::npos) << r.out;
  // Truncated checkpoint
  const std::string bytes = testing::read_text_file(repo_path("models/stories260K/stories260K.bin"));
  testing::write_file(dir + "/trunc.bin", bytes.substr(0, 5000));
  r = run_cli("generate --model " + dir + "/trunc.bin --tokenizer " + repo_path("models/stories260K/tok512.bin") + " --prompt hi");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("trunc.bin"), std::string::npos) << r.out;
  // Bad JSON config
  std::filesystem::create_directories(dir + "/hf");
  testing::write_file(dir + "/hf/config.json", "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": ");
  r = run_cli("inspect " + dir + "/hf");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("config.json"), std::string::npos) << r.out;
  // Prompt longer than the context
  std::string long_prompt;
  for (int i = 0; i < 400; ++i) long_prompt += "Lily played. ";
  testing::write_file(dir + "/long.txt", long_prompt);
  r = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") + " --prompt-file " + dir + "/long.txt -n 4");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("longer than the context limit of 512"), std::string::npos) << r.out;
  // Missing prompt file, unknown synthetic name, bad option value
  r = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") + " --prompt-file " + dir + "/nope.txt");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("nope.txt"), std::string::npos);
  r = run_cli("generate --synthetic gpt-5");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("unknown synthetic model 'gpt-5'"), std::string::npos);
  r = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") + " --prompt hi --top-p 1.5");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("top_p"), std::string::npos);
}

TEST(Cli, GenerateRunsSpeContextByDefaultOnTheBundledModel) {
  const CliRun r = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                               " --prompt 'Once upon a time' -n 150 --json",
                           false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["sparse"], "specontext");
  EXPECT_EQ(j["budget"].get<int>(), 64);  // 512-token context / 8
  EXPECT_GT(j["sparse_steps"].get<int>(), 80);
  EXPECT_GT(j["mean_overlap"].get<double>(), 0.5);
  EXPECT_GT(j["bytes_loaded_per_token"].get<double>(), 0.0);
  EXPECT_LT(j["bytes_loaded_per_token"].get<double>(), 0.5 * j["bytes_full_reload_per_token"].get<double>());
  // Dense on request; an unknown method and a missing head are clear errors.
  const CliRun d = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                               " --prompt 'Once upon a time' -n 20 --sparse dense --json", false);
  ASSERT_EQ(d.exit_code, 0);
  EXPECT_EQ(nlohmann::json::parse(d.out)["sparse"], "dense");
  CliRun e = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") + " --prompt hi --sparse magic");
  EXPECT_NE(e.exit_code, 0);
  e = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") + " --prompt hi --head /nope/head.safetensors");
  EXPECT_EQ(e.exit_code, 1);
  EXPECT_NE(e.out.find("/nope/head.safetensors"), std::string::npos) << e.out;
}

TEST(Cli, InspectPrintsShapeAndKvBytes) {
  const CliRun r = run_cli("inspect --json " + repo_path("models/babyllama105/babyllama105.gguf"), false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["architecture"], "llama");
  EXPECT_EQ(j["format"], "gguf");
  EXPECT_GT(j["parameters"].get<int64_t>(), 900000);
  EXPECT_EQ(j["kv_bytes_per_token"].get<int64_t>(),
            2 * j["layers"].get<int64_t>() * j["kv_heads"].get<int64_t>() * j["head_dim"].get<int64_t>() * 4);
  EXPECT_GT(j["max_context"].get<int64_t>(), 0);
  // Every matrix of this file is stored F32: 7 per layer, the embedding and the output.
  EXPECT_EQ(j["stored_types"]["F32"].get<int64_t>(), 7 * j["layers"].get<int64_t>() + 2) << j.dump();
}

// A Q4_K GGUF (random weights, the stories260K vocabulary): `inspect` and `generate --json` say
// what is held: the blocks as stored with --dtype auto on the CPU backend (about the file's
// size), f32 with --dtype f32, and f32 when the backend cannot run blocks (--reference).
TEST(Cli, QuantizedWeightsHeldAsStoredAndReported) {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.dim = 256;
  c.hidden_dim = 512;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.vocab_size = 512;
  c.max_seq_len = 256;  // untied: token_embd, output and 2 x 7 matrices
  const std::string path = testing::temp_dir("cli_quantized") + "/q4_k.gguf";
  ASSERT_TRUE(write_random_gguf(path, c, DType::kQ4_K, 1).is_ok());
  const int64_t file_bytes = static_cast<int64_t>(std::filesystem::file_size(path));
  CliRun r = run_cli("inspect --json " + path, false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["weights_held"]["types"], nlohmann::json({{"q4_k", 16}})) << j.dump();
  EXPECT_LE(j["weights_held"]["bytes"].get<int64_t>(), file_bytes);
  EXPECT_GE(j["weights_held"]["bytes"].get<int64_t>(), file_bytes - 8192);
  r = run_cli("inspect --json --dtype f32 " + path, false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["weights_held"]["types"], nlohmann::json({{"f32", 16}})) << j.dump();
  EXPECT_GT(j["weights_held"]["bytes"].get<int64_t>(), 3 * file_bytes);

  const std::string gen = "generate --model " + path + " --tokenizer " + repo_path("models/stories260K/tok512.bin") +
                          " --prompt 'Once upon a time' -n 4 --json --threads 2";
  for (const auto& [flags, type] : {std::pair<std::string, std::string>{"", "q4_k"}, {" --dtype f32", "f32"},
                                    {" --reference", "f32"}}) {
    r = run_cli(gen + flags, false);
    ASSERT_EQ(r.exit_code, 0) << flags << ": " << r.out;
    j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["weights_held"]["types"], nlohmann::json({{type, 16}})) << flags << ": " << j.dump();
    EXPECT_GE(j["generated_tokens"].get<int>(), 1) << flags;  // random weights may stop early
  }
}

// --dtype bf16 holds the weights in bf16 (half the memory); the greedy text of the bundled model
// starts as with f32 weights.
TEST(Cli, DtypeBf16HoldsTheWeightsInBf16) {
  const std::string base = "generate --model " + repo_path("models/stories260K/stories260K.bin") +
                           " --prompt 'Once upon a time' -n 40 --json --dtype ";
  for (const char* dtype : {"bf16", "f32", "auto"}) {
    const CliRun r = run_cli(base + dtype, false);
    ASSERT_EQ(r.exit_code, 0) << dtype << ": " << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["weight_dtype"], std::string(dtype) == "bf16" ? "bf16" : "f32") << dtype;
    EXPECT_EQ(j["generated_tokens"].get<int>(), 40);
    EXPECT_EQ(j["text"].get<std::string>().rfind(", there was a little girl named Lily.", 0), 0u) << dtype << ": " << j["text"];
  }
  const CliRun bad = run_cli(base + "f16");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--dtype"), std::string::npos) << bad.out;
}

}  // namespace
}  // namespace specontext

namespace specontext {
namespace {

// KV tiers from the command line: layers offloaded to a host pool and a loopback remote node give
// the all-device text, the JSON reports tiers, probe, overlap and placement decisions, and a
// request that fits no tier is refused with the reason and exit code 1.
TEST(Cli, GenerateWithTiersMatchesAllDeviceTextAndReportsTiers) {
  const std::string base = "generate --model " + repo_path("models/stories260K/stories260K.bin") +
                           " --prompt 'Once upon a time' -n 120 --json --budget 32";
  const CliRun dev = run_cli(base, false);
  ASSERT_EQ(dev.exit_code, 0) << dev.out;
  const auto jd = nlohmann::json::parse(dev.out);
  // 5 layers of 256 B per token and their working sets: 260 KiB of device memory hold about 100
  // tokens of every layer, so layers leave for host0 (and remote0) as the text grows.
  const std::string tiers = " --device-kv 260KiB --host-kv 256KiB --remote-kv 1MiB";
  const CliRun tier = run_cli(base + tiers, false);
  ASSERT_EQ(tier.exit_code, 0) << tier.out;
  const auto jt = nlohmann::json::parse(tier.out);
  EXPECT_EQ(jt["text"], jd["text"]) << "offloading changed the text";
  const auto& t = jt["tiering"];
  ASSERT_EQ(t["tiers"].size(), 3u);
  EXPECT_EQ(t["tiers"][0]["name"], "device");
  EXPECT_EQ(t["tiers"][1]["kind"], "host");
  EXPECT_EQ(t["tiers"][2]["kind"], "remote");
  EXPECT_GE(t["placement_events"].size(), 1u);
  EXPECT_FALSE(t["placement_events"][0]["reasons"].empty());
  int offloaded = 0;
  for (const auto& h : t["layer_homes"]) offloaded += h.get<int>() != 0;
  EXPECT_GT(offloaded, 0) << t.dump();
  EXPECT_GT(t["tiers"][0]["total"]["bytes_in"].get<int64_t>(), 0);
  EXPECT_GE(t["probe"].size(), 4u);  // host0 and remote0, both directions
  for (const auto& p : t["probe"]) EXPECT_GT(p["contiguous_bps"].get<double>(), 0.0) << p.dump();
  EXPECT_GT(t["overlap"]["steps"].get<int64_t>(), 0);
  // A static plan for the final length offloads from the start and never moves again.
  const CliRun st = run_cli(base + tiers + " --placement static", false);
  ASSERT_EQ(st.exit_code, 0) << st.out;
  const auto js = nlohmann::json::parse(st.out);
  EXPECT_EQ(js["text"], jd["text"]);
  ASSERT_EQ(js["tiering"]["placement_events"].size(), 1u);
  EXPECT_EQ(js["tiering"]["placement_events"][0]["forward"].get<int>(), 0) << "static plans move before the first step";
  int static_offloaded = 0;
  for (const auto& h : js["tiering"]["layer_homes"]) static_offloaded += h.get<int>() != 0;
  EXPECT_GE(static_offloaded, offloaded) << "the plan for the final length offloads at least what growing needed";
  EXPECT_TRUE(js["tiering"].contains("static_plan"));
}

TEST(Cli, GenerateRefusesWhatFitsNoTier) {
  const CliRun r = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                           " --prompt 'Once upon a time' -n 400 --budget 32 --device-kv 64KiB --host-kv 16KiB");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("refused"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cannot be placed"), std::string::npos) << r.out;
  const CliRun bad = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                             " --prompt 'x' -n 4 --device-kv 1MiB");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.out.find("--device-kv needs --host-kv, --remote-kv or --kv-node"), std::string::npos) << bad.out;
  // Dense attention (as quest and oracle) stages a remote layer's whole KV on the device, a ring of
  // --staging-layers layers at a time: with most layers remote, the text is the all-device text.
  for (const char* method : {"dense", "quest", "oracle"}) {
    SCOPED_TRACE(method);
    const std::string run = "generate --model " + repo_path("models/stories260K/stories260K.bin") +
                            " --prompt 'Once upon a time' -n 300 -B 32 --json --sparse " + method;
    const CliRun alone = run_cli(run, false);
    const CliRun remote = run_cli(run + " --device-kv 400KiB --host-kv 64KiB --remote-kv 2MiB", false);
    ASSERT_EQ(alone.exit_code, 0) << alone.out;
    ASSERT_EQ(remote.exit_code, 0) << remote.out;
    const auto a = nlohmann::json::parse(alone.out), t = nlohmann::json::parse(remote.out);
    EXPECT_EQ(t["text"], a["text"]);
    int remote_layers = 0;
    for (int h : t["tiering"]["layer_homes"]) remote_layers += h == 2;
    EXPECT_GE(remote_layers, 3) << t["tiering"]["layer_homes"];
    EXPECT_GT(t["tiering"]["staging_peak_bytes"].get<uint64_t>(), 0u);
  }
  // A device too small to stage two layers of the request refuses it, naming the device tier.
  const CliRun small = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                               " --prompt 'Once upon a time' -n 400 --sparse dense --device-kv 300KiB "
                               "--host-kv 64KiB --remote-kv 2MiB");
  EXPECT_NE(small.exit_code, 0) << small.out;
  EXPECT_NE(small.out.find("cannot be placed: the device tier"), std::string::npos) << small.out;
  const CliRun dense_host = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                                    " --prompt 'Once upon a time' -n 300 --sparse dense --device-kv 300KiB "
                                    "--host-kv 1MiB --json");
  EXPECT_EQ(dense_host.exit_code, 0) << "host tiers are read in place under dense attention: " << dense_host.out;
  const CliRun size = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                              " --prompt 'x' -n 4 --host-kv 12XB");
  EXPECT_EQ(size.exit_code, 1);
  EXPECT_NE(size.out.find("--host-kv"), std::string::npos) << size.out;
}

TEST(Cli, CudaBackendFallsBackToCpuWithoutADevice) {
  const CliRun r = run_cli("generate --model " + repo_path("models/stories260K/stories260K.bin") +
                           " --prompt 'Once upon a time' -n 8 --backend cuda");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  // Here (no GPU in CI) the note says why; with a device it runs on it.
  if (r.out.find("falling back to the CPU backend") == std::string::npos) {
    EXPECT_NE(r.out.find("decode:"), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace specontext
