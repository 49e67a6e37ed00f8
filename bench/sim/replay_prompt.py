#!/usr/bin/env python3
"""Replays chosen requests of a bench_loadgen --record-text run, one at a time, against fresh
`specontext serve` processes (stories260K, --max-batch 8; nothing else in flight), with different
amounts of the prompt in the prefix cache: none ("cold"), after each of the two previous turns of its
conversation was sent (so their prompts and answers are cached), and after the prompt itself.
Each with the default SpeContext attention and with --sparse dense. Prints each answer with the
prompt tokens served from the cache: does the answer depend on the cache alone (no batching)?
    replay_prompt.py TRACE.jsonl RUN.json INDEX[,INDEX...]
The prompts are rebuilt from the trace and the run's texts (a session's prefix, earlier prompts and
answers, its own prompt) and checked against the run's prompt_fnv1a."""
import http.client
import json
import subprocess
import sys

BIN = "build/release/bin/specontext"
MODEL = "models/stories260K/stories260K.bin"


def fnv1a64(s):
    h = 0xCBF29CE484222325
    for c in s.encode():
        h = ((h ^ c) * 0x100000001B3) & (2**64 - 1)
    return "%016x" % h


def main():
    trace = [json.loads(line) for line in open(sys.argv[1]) if line.strip() and not line.startswith("#")]
    prefixes = {t["define_prefix"]: t["text"] for t in trace if "define_prefix" in t}
    reqs = [t for t in trace if "arrival_s" in t]
    run = json.load(open(sys.argv[2]))["requests"]

    def prompt_of(i):
        text = prefixes.get(reqs[i].get("prefix"), "")
        for j in range(i):
            if reqs[i].get("session") and reqs[j].get("session") == reqs[i]["session"]:
                text += reqs[j]["prompt"] + run[j]["text"]
        return text + reqs[i]["prompt"]

    def complete(port, prompt):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"model": "stories", "prompt": prompt, "max_tokens": reqs[0]["max_tokens"], "temperature": 0,
                "ignore_eos": True}
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = json.loads(c.getresponse().read())
        return r["choices"][0]["text"], r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0), \
            r["usage"]["prompt_tokens"]

    def fresh(extra, warm, prompt):
        p = subprocess.Popen([BIN, "serve", "-m", MODEL, "--served-model-name", "stories", "--listen", "127.0.0.1:0",
                              "--max-batch", "8"] + extra, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            port = json.loads(p.stdout.readline())["port"]
            if warm is not None:
                complete(port, warm)
            return complete(port, prompt)
        finally:
            p.terminate()
            p.wait()

    for i in [int(x) for x in sys.argv[3].split(",")]:
        prompt = prompt_of(i)
        if fnv1a64(prompt) != run[i]["prompt_fnv1a"]:
            sys.exit(f"request {i}: the rebuilt prompt is not the run's")
        earlier = [j for j in range(i) if reqs[i].get("session") and reqs[j].get("session") == reqs[i]["session"]]
        warmups = [("cold", None)] + [(f"after turn {j}", prompt_of(j)) for j in earlier[-2:]] + [("after itself", prompt)]
        for name, extra in (("specontext", []), ("dense", ["--sparse", "dense"])):
            print(json.dumps({"request": i, "attention": name, "in_the_run": run[i]["text"],
                              "cached_in_the_run": run[i]["cached_tokens"]}))
            for label, warm in warmups:
                text, cached, total = fresh(extra, warm, prompt)
                print(json.dumps({"cache": label, "cached_tokens": cached, "prompt_tokens": total, "text": text}))


if __name__ == "__main__":
    main()
