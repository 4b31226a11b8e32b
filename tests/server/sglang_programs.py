"""Programs in SGLang's frontend language, run by the real `sglang` package against a
`preheat serve`: `python sglang_programs.py URL OUT.json` runs them all and writes what each
produced (texts, meta_info) for tests/server/test_sglang_frontend.py to check.

A separate process, as a user's script is: importing `sglang` patches transformers and sets
cache variables process-wide, which must not leak into the test process. Every program is
written as SGLang's docs write them; the seed article's programs (shared/seeds/002) are kept
as they are printed there, with only their URL adapted. (shared/seeds/001's snippet calls
`Runtime(url)`, which starts a local SGLang server, and `with assistant()` without a state:
it runs on no SGLang, so it is not here; its parts, multi-turn history and a regex answer,
are.)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import sglang as sgl
from sglang import assistant, function, gen, select, system, user

PERSON_SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
})

# A system prompt long enough to fill several KV pages, unique to this module.
LONG_SYSTEM = ("You are the reference desk of the Preheat test library. Answer in one short "
               "sentence, name your source when you have one, and never invent a fact. "
               "Questions come from engineers checking that a warm server reuses this very "
               "system prompt from its prefix cache on the second run of the same program.")


@function
def arithmetic(s, question):
    s += system("You are a helpful assistant.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=16, temperature=0, stop="\n"))


@function
def capital(s):
    s += "The capital of France is" + select("city", choices=[" Paris", " London", " Berlin"])


@function
def three_digits(s):
    s += user("Give me a three-digit number.")
    s += assistant(gen("number", max_tokens=8, regex=r"[0-9]{3}", temperature=0))


@function
def person(s):
    s += user("Describe a person as JSON with a name and an age.")
    s += assistant(gen("person", max_tokens=64, json_schema=PERSON_SCHEMA, temperature=0))


@function
def limited(s):
    s += user("Write a long story about a lighthouse.")
    s += assistant(gen("story", max_tokens=5, temperature=0, ignore_eos=True))


@function
def stop_at_period(s):
    s += user("Say a sentence about the sea, then another one.")
    s += assistant(gen("sentence", max_tokens=48, temperature=0, stop="."))


@function
def two_fruits(s):
    s += "Here are two fruits:\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"{i + 1}." + gen("fruit", max_tokens=6, temperature=0, stop="\n")
    s += "1." + forks[0]["fruit"] + "\n2." + forks[1]["fruit"]


@function
def conversation(s):
    s += system("You are a terse assistant. Answer with one word.")
    s += user("What color is the sky on a clear day?")
    s += assistant(gen("first", max_tokens=8, temperature=0, stop="\n"))
    s += user("And what color is grass?")
    s += assistant(gen("second", max_tokens=8, temperature=0, stop="\n"))


@function
def reference_desk(s, question):
    s += system(LONG_SYSTEM)
    s += user(question)
    s += assistant(gen("answer", max_tokens=12, temperature=0))


@function
def count(s):
    s += user("Count from one to five in words.")
    s += assistant(gen("answer", max_tokens=24, temperature=0))


# ---- shared/seeds/002: "2.1 显式模型预热" and "2.4 自定义预热模板", as printed.

@function
def warmup_flow(s):
    s += user("你好")
    s += assistant(gen("response", max_tokens=8))


@function
def json_warmup(s):
    s += user("请生成一个包含姓名、年龄和城市信息的JSON对象。")
    s += assistant(
        gen(
            "json_output",
            max_tokens=128,
            regex=r'\{.*?"name".*?\}',  # 强制JSON格式
        )
    )


def meta(state: Any, name: str) -> dict:
    return state.get_meta_info(name) or {}


def main(url: str, out_path: str) -> None:
    results: dict[str, Any] = {}
    backend = sgl.RuntimeEndpoint(url)
    sgl.set_default_backend(backend)
    results["model_info"] = backend.model_info
    results["server_info_version"] = backend.get_server_info().get("version")

    st = arithmetic.run(question="What is 2+2?")
    results["arithmetic"] = {"answer": st["answer"], "meta": meta(st, "answer")}
    st = capital.run()
    results["capital"] = {"city": st["city"], "meta": meta(st, "city")}
    st = three_digits.run()
    results["three_digits"] = st["number"]
    st = person.run()
    results["person"] = st["person"]
    st = limited.run()
    results["limited"] = {"story": st["story"], "meta": meta(st, "story")}
    st = stop_at_period.run()
    results["stop"] = {"sentence": st["sentence"], "meta": meta(st, "sentence")}
    st = two_fruits.run()
    results["fork"] = {"text": st.text()}
    st = conversation.run()
    results["conversation"] = {"first": st["first"], "second": st["second"],
                               "roles": [m["role"] for m in st.messages()]}
    batch = arithmetic.run_batch([{"question": "What is 2+2?"}, {"question": "What is 3+3?"},
                                  {"question": "Name a color."}])
    results["batch"] = [b["answer"] for b in batch]

    backend.flush_cache()  # the next program starts from a cold cache
    results["prefix_reuse"] = []
    for _ in range(2):  # one after the other: run() returns at once, reading a variable waits
        r = reference_desk.run(question="Who wrote Hamlet?")
        r["answer"]
        results["prefix_reuse"].append(meta(r, "answer"))

    st = count.run(stream=True)
    chunks = list(st.text_iter(var_name="answer"))
    results["stream"] = {"chunks": chunks, "final": st["answer"]}

    # shared/seeds/002, with the article's URL replaced by this server's.
    backend = sgl.RuntimeEndpoint(url)
    sgl.set_default_backend(backend)
    ret = warmup_flow.run()
    print("✅ 预热完成，服务已就绪:", ret["response"])
    results["seed_warmup"] = {"response": ret["response"], "meta": meta(ret, "response")}
    ret = json_warmup.run()
    print("🧪 结构化预热输出:", ret["json_output"])
    results["seed_json"] = {"json_output": ret["json_output"], "meta": meta(ret, "json_output")}
    with open(out_path, "w") as f:
        json.dump(results, f, ensure_ascii=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
