// `specontext SUBCOMMAND` as a child process, for the tests that start one (server_process_test,
// router_process_test, tests/bench/loadgen_test): the port comes from its first stdout line. The
// including test defines SPECONTEXT_BIN (the `specontext` binary's path).
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace specontext::testing {

// A `specontext ARGS...` child (ARGS[0] the subcommand) with stdout and stderr captured; the
// port comes from its first line.
class SpecontextProcess {
 public:
  explicit SpecontextProcess(std::vector<std::string> args) {
    args.insert(args.begin(), SPECONTEXT_BIN);
    int out[2], err[2];
    if (pipe(out) != 0 || pipe(err) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      dup2(err[1], STDERR_FILENO);
      for (int fd : {out[0], out[1], err[0], err[1]}) close(fd);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(SPECONTEXT_BIN, argv.data());
      _exit(127);
    }
    close(out[1]);
    close(err[1]);
    out_ = fdopen(out[0], "r");
    err_ = fdopen(err[0], "r");
    std::array<char, 4096> line{};
    if (fgets(line.data(), line.size(), out_) != nullptr) {
      first_line_ = line.data();
      auto j = nlohmann::json::parse(first_line_, nullptr, false);
      if (j.is_object() && j.contains("port")) port_ = j["port"].get<uint16_t>();
    }
  }
  ~SpecontextProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_) fclose(out_);
    if (err_) fclose(err_);
  }
  uint16_t port() const { return port_; }
  const std::string& first_line() const { return first_line_; }
  // Sends `sig` (0: none) and waits: exit code, the rest of stdout, all of stderr.
  struct Exit {
    int code = -1;
    std::string out, err;
  };
  Exit wait(int sig) {
    if (sig != 0) ::kill(pid_, sig);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    Exit e;
    e.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::array<char, 4096> buf{};
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), out_)) > 0) e.out.append(buf.data(), n);
    while ((n = fread(buf.data(), 1, buf.size(), err_)) > 0) e.err.append(buf.data(), n);
    return e;
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  FILE* err_ = nullptr;
  uint16_t port_ = 0;
  std::string first_line_;
};

// `specontext serve ARGS...`.
class ServeProcess : public SpecontextProcess {
 public:
  explicit ServeProcess(std::vector<std::string> args) : SpecontextProcess(with_serve(std::move(args))) {}

 private:
  static std::vector<std::string> with_serve(std::vector<std::string> args) {
    args.insert(args.begin(), "serve");
    return args;
  }
};

}  // namespace specontext::testing
