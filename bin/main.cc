// specontext: one binary, subcommands (generate, serve, inspect, plan, distill, eval, kv-node, router).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>

#include "bin/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"SpeContext: long-context LLM decoding with speculative context sparsity"};
  app.require_subcommand(1);
  specontext::cli::GenerateArgs gen;
  specontext::cli::InspectArgs inspect;
  specontext::cli::PlanArgs plan;
  specontext::cli::EvalArgs eval;
  specontext::cli::DistillArgs distill;
  specontext::cli::register_generate(app, gen);
  specontext::cli::register_inspect(app, inspect);
  specontext::cli::register_plan(app, plan);
  specontext::cli::register_eval(app, eval);
  specontext::cli::register_distill(app, distill);
  specontext::cli::KvNodeArgs kv_node;
  specontext::cli::register_kv_node(app, kv_node);
  specontext::cli::ServeArgs serve;
  specontext::cli::register_serve(app, serve);
  specontext::cli::RouterArgs router;
  specontext::cli::register_router(app, router);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (app.got_subcommand("generate")) return specontext::cli::run_generate(gen);
  if (app.got_subcommand("inspect")) return specontext::cli::run_inspect(inspect);
  if (app.got_subcommand("plan")) return specontext::cli::run_plan(plan);
  if (app.got_subcommand("eval")) return specontext::cli::run_eval(eval);
  if (app.got_subcommand("distill")) return specontext::cli::run_distill(distill);
  if (app.got_subcommand("kv-node")) return specontext::cli::run_kv_node(kv_node);
  if (app.got_subcommand("serve")) return specontext::cli::run_serve(serve);
  if (app.got_subcommand("router")) return specontext::cli::run_router(router);
  return 2;
}
