#!/usr/bin/env python3
"""Writes tests/data/chat_deepseek_r1.json: conversations and the text DeepSeek-R1's own chat
template renders for them, with Jinja2 set up as Hugging Face's apply_chat_template sets it
(trim_blocks, lstrip_blocks; bos_token, add_generation_prompt=True).

TEMPLATE is the "chat_template" of tokenizer_config.json in deepseek-ai/DeepSeek-R1-Distill-Llama-8B
and -Qwen-7B (MIT licence), as quoted in public code. Run with Debian's python3-jinja2:

  /usr/bin/python3 tests/data/make_chat_deepseek_r1.py
"""
import json

import jinja2

TEMPLATE = "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CASES = {
    "one_user_turn": [{"role": "user", "content": "What is 2 + 3?"}],
    "system_and_history": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
        {"role": "user", "content": "again"},
    ],
    "two_systems_last_wins": [
        {"role": "system", "content": "first"},
        {"role": "user", "content": "u"},
        {"role": "system", "content": "second"},
    ],
    "tool_calls_and_results": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("get_weather", "{\"city\": \"Paris\"}"), call("get_weather", "{\"city\": \"Rome\"}")]},
        {"role": "tool", "content": "18C"},
        {"role": "tool", "content": "24C"},
        {"role": "assistant", "content": "Paris 18C, Rome 24C."},
        {"role": "user", "content": "Thanks"},
    ],
    "ends_on_a_tool_result": [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [call("now", "{}")]},
        {"role": "tool", "content": "12:00"},
    ],
}


def main():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(TEMPLATE)
    out = []
    for name, messages in CASES.items():
        text = template.render(messages=messages, bos_token="<｜begin▁of▁sentence｜>", add_generation_prompt=True)
        out.append({"name": name, "messages": messages, "expected": text})
    with open("tests/data/chat_deepseek_r1.json", "w", encoding="utf-8") as f:
        json.dump({"generator": "tests/data/make_chat_deepseek_r1.py (jinja2 %s)" % jinja2.__version__, "cases": out},
                  f, ensure_ascii=False, indent=1)
        f.write("\n")
    print("wrote", len(out), "cases")


if __name__ == "__main__":
    import jinja2.sandbox  # noqa: F401  (ImmutableSandboxedEnvironment lives there)
    main()
