"""The bundled longctx model through `specontext serve`'s /v1/chat/completions, as train.py's chat
documents taught it: 20 context questions (facts "The code for K is V." in VAL prose in the user
turn, then "What is the code for K?") and 20 `lookup_code` tool calls (is the call's argument the
asked key?). Greedy; the tool, system prompt, fact sentence, keys and values from tasks.json (as
train.py wrote them); prose from the last 8.5% of Pride and Prejudice (VAL, never Persuasion).

    specontext serve -m models/longctx/hf --listen 127.0.0.1:PORT &
    /usr/bin/python3 models/longctx/chat_check.py --port PORT [--model hf]
"""
import argparse
import json
import os
import random
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def chat(args, tasks, user, **body):
    """The assistant's message for one user turn after the trained system prompt."""
    body = {"model": args.model, "temperature": 0, **body,
            "messages": [{"role": "system", "content": tasks["system"]}, {"role": "user", "content": user}]}
    req = urllib.request.Request(f"http://{args.host}:{args.port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["message"]


def context_questions(args, tasks, prose, rng):
    ok = 0
    for _ in range(args.n):
        n = rng.randint(2, 6)
        ks, vs = rng.sample(tasks["keys"], n), [rng.choice(tasks["values"]) for _ in range(n)]
        sentences = prose[rng.randrange(len(prose) - 3000):][:1200].split(". ")
        ctx = ""
        for j, s in enumerate(sentences[:2 * n]):
            fact = tasks["templates"]["code_fact"].format(key=ks[j // 2], val=vs[j // 2]) if j % 2 == 1 else ""
            ctx += s + "." + fact + " "
        q = rng.randrange(n)
        m = chat(args, tasks, ctx.strip() + "\n\nWhat is the code for " + ks[q] + "?", max_tokens=16)
        text = m.get("content") or ""
        good = text.strip().startswith(f"The code for {ks[q]} is {vs[q]}")
        ok += good
        print(json.dumps({"check": "context", "key": ks[q], "want": vs[q], "got": text[:60], "ok": good}))
    return ok


def tool_calls(args, tasks, rng):
    ok = called = 0
    for k in rng.sample(tasks["keys"], args.n):
        m = chat(args, tasks, "What is the code for " + k + "?", max_tokens=48, tools=[tasks["tool"]])
        calls = m.get("tool_calls") or []
        arg = None
        if calls:
            called += 1
            try:
                arg = json.loads(calls[0]["function"]["arguments"]).get("key")
            except (ValueError, AttributeError):
                arg = calls[0]["function"]["arguments"]
        ok += arg == k
        print(json.dumps({"check": "tool", "key": k, "tool_call": bool(calls), "argument": arg,
                          "content": (m.get("content") or "")[:80]}))
    return called, ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--model", default="hf")
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    tasks = json.load(open(os.path.join(HERE, "tasks.json"), encoding="utf-8"))
    text = open(os.path.join(HERE, "..", "..", "data", "austen", "prideprejudice.txt"), encoding="utf-8").read()
    rng = random.Random(args.seed)
    answered = context_questions(args, tasks, text[int(0.915 * len(text)):], rng)
    called, right = tool_calls(args, tasks, rng)
    print(json.dumps({"context_questions": args.n, "answered": answered,
                      "tool_requests": args.n, "tool_calls_parsed": called, "argument_is_the_key": right}))


if __name__ == "__main__":
    main()
