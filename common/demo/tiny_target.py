"""A tiny target LLM the project builds locally: tokenizer, model, chat template, brief training.

Nothing is downloaded. The embedded default pipeline, the tests and the demo serve this model
with a real vLLM (CPU build), so it has the files a real chat model has:

- tokenizer.json + tokenizer_config.json: a byte-level BPE (vocab 2048) trained with `tokenizers`
  on the project's own synthetic chat corpus, special tokens `<|endoftext|>` (pad), `<|im_start|>`,
  `<|im_end|>` (eos for chat), `<think>`, `</think>` and a Qwen3-style chat template;
- config.json + model.safetensors (float32) + generation_config.json (eos = <|im_end|>, <|endoftext|>).

Families: "llama" (LlamaForCausalLM, 4 layers, hidden 128), "qwen3" (Qwen3ForCausalLM, same size,
head_dim 32) and "deepseek_v3" (DeepseekV3ForCausalLM, tiny MLA + MoE shaped like Kimi-K2.5 / DeepSeek-V3:
the Kimi-shaped proxy of the end-to-end test).

Why train: a randomly initialised target has near-uniform logits and a draft head learns nothing
that generalises from it (docs/design.md#the-tiny-target). So llama and qwen3 are trained briefly (plain AdamW, CPU) on
a deterministic synthetic chat corpus: templated questions (math, code, writing, facts, reasoning,
multi-turn) with templated, structured answers that start with a `<think>` reasoning part. The
trained model answers in that format, e.g. `<think>\\n...\\n</think>\\n\\nHere is ...<|im_end|>`.

The same generator writes the embedded sample dataset (data/sample_prompts.jsonl, via
scripts/make_sample_data.py), so the prompts the pipeline sends are in the target's distribution.

Cost, measured on the 2-core dev machine: the default llama (or qwen3) build trains 1000 steps of
8 x 256 tokens, about 320 CPU-seconds (0.32 s/step on one core, so about 5.5 min on one thread)
plus about 5 s for corpus and tokenizer, and ends at a training loss of 0.24 (from 7.70). On an
idle 2-core machine it trains with 2 threads, which should take about 3 min; that was not measured
because the dev machine was never idle. On a busy machine it uses 1 thread (see training_threads).
deepseek_v3 trains DEEPSEEK_STEPS (300) steps: its MoE layers cost about 1.3 s/step on a busy core, so
about 6.5 min (untrained, --no-train: about 3 s). `ensure_tiny_target` builds once into
${EAGLE3_CACHE:-~/.cache/eagle3-pipeline}/tiny-targets/<family>-<hash>/ and reuses it; the hash
covers this file, so editing it triggers one rebuild.

CLI:
    python -m common.demo.tiny_target --family llama --out DIR       # build into DIR
    python -m common.demo.tiny_target --family llama --print-path    # build into the cache (once), print the path
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

FAMILIES = ("llama", "qwen3", "deepseek_v3")
VOCAB_SIZE = 2048
MAX_POSITION_EMBEDDINGS = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Training defaults of the embedded target (the cache key includes them).
DEFAULT_STEPS = 1000
DEEPSEEK_STEPS = 300  # enough for structured answers; its MoE makes a step ~2.5x a llama step
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEQ_LEN = 256
DEFAULT_LR = 3e-3
CORPUS_CONVERSATIONS = 4000

# Qwen3-style: one block per message; an assistant message with reasoning gets a think block.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- elif message['content'] -%}"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\\n') -%}"
    "{%- else -%}{%- set content = '' -%}{%- endif -%}"
    "{%- set reasoning = message.get('reasoning') or message.get('reasoning_content') or '' -%}"
    "{%- if message['role'] == 'assistant' and reasoning -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


# ---------------------------------------------------------------------------------------------
# The synthetic chat corpus. Every generator returns one turn: the user text, the assistant's
# reasoning and answer, plus a subject and a short summary that follow-up turns refer to.
# Answers are fixed templates of the question's slots, so a tiny model can learn them.
# ---------------------------------------------------------------------------------------------

NAMES = ["Alice", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kira", "Liam", "Maya", "Noah", "Olga", "Pedro"]
ITEMS = ["apple", "book", "marble", "pencil", "cookie", "sticker", "coin", "card", "shell", "stamp"]
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Brazil": "Brasilia", "Canada": "Ottawa",
    "Australia": "Canberra", "Egypt": "Cairo", "Kenya": "Nairobi", "Mexico": "Mexico City", "Norway": "Oslo",
    "Sweden": "Stockholm", "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara", "Argentina": "Buenos Aires",
    "Chile": "Santiago", "Peru": "Lima", "Vietnam": "Hanoi", "Thailand": "Bangkok", "Ireland": "Dublin",
    "Austria": "Vienna", "Finland": "Helsinki", "Morocco": "Rabat", "Nigeria": "Abuja", "South Korea": "Seoul",
}
CONCEPTS = {
    "photosynthesis": "the process plants use to turn sunlight, water and carbon dioxide into sugar and oxygen",
    "gravity": "the force that pulls objects with mass toward each other",
    "an atom": "the smallest unit of a chemical element, made of a nucleus and electrons",
    "DNA": "the molecule that carries the genetic instructions of living things",
    "a volcano": "an opening in the Earth's crust where molten rock, ash and gas escape",
    "inflation": "the general rise of prices over time, which lowers what money can buy",
    "an algorithm": "a finite list of precise steps that solves a problem",
    "the internet": "a global network of computers that exchange data using shared protocols",
    "a black hole": "a region of space where gravity is so strong that not even light escapes",
    "evaporation": "the change of a liquid into a gas at its surface",
    "a vaccine": "a preparation that trains the immune system to recognise a germ",
    "democracy": "a system of government in which citizens choose their leaders by voting",
    "an ecosystem": "a community of living things together with their physical environment",
    "electricity": "the flow of electric charge, usually electrons moving through a conductor",
    "a prime number": "a whole number greater than 1 whose only divisors are 1 and itself",
    "machine learning": "a way of building programs that learn patterns from data instead of fixed rules",
}
ANIMALS = {
    "octopus": "has three hearts and blue blood", "elephant": "can recognise itself in a mirror",
    "honeybee": "communicates the direction of flowers with a waggle dance", "penguin": "cannot fly but swims very fast",
    "giraffe": "has the same number of neck bones as a human", "owl": "can turn its head about 270 degrees",
    "dolphin": "sleeps with one half of its brain at a time", "cheetah": "is the fastest land animal",
    "sloth": "moves so slowly that algae grow on its fur", "hummingbird": "can fly backwards",
    "camel": "stores fat, not water, in its hump", "kangaroo": "cannot walk backwards easily",
}
CODE_TASKS = [
    ("reverses a string", "reverse_string", "def reverse_string(s):\n    return s[::-1]"),
    ("counts the vowels in a string", "count_vowels", "def count_vowels(s):\n    return sum(1 for c in s.lower() if c in \"aeiou\")"),
    ("checks whether a number is prime", "is_prime", "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n        if n % d == 0:\n            return False\n    return True"),
    ("returns the factorial of n", "factorial", "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result"),
    ("computes the n-th Fibonacci number", "fibonacci", "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"),
    ("removes duplicates from a list while keeping the order", "dedupe", "def dedupe(items):\n    seen = set()\n    return [x for x in items if not (x in seen or seen.add(x))]"),
    ("finds the largest number in a list", "largest", "def largest(numbers):\n    best = numbers[0]\n    for x in numbers[1:]:\n        if x > best:\n            best = x\n    return best"),
    ("checks whether a string is a palindrome", "is_palindrome", "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]"),
    ("sums the even numbers in a list", "sum_even", "def sum_even(numbers):\n    return sum(x for x in numbers if x % 2 == 0)"),
    ("converts Celsius to Fahrenheit", "celsius_to_fahrenheit", "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32"),
    ("counts the words in a sentence", "count_words", "def count_words(sentence):\n    return len(sentence.split())"),
    ("flattens a nested list", "flatten", "def flatten(items):\n    out = []\n    for x in items:\n        if isinstance(x, list):\n            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out"),
]
SUBJECTS = [
    "the ocean", "autumn leaves", "a quiet city at night", "a lighthouse", "the first snow", "a cup of coffee",
    "an old library", "a mountain trail", "the moon", "a summer storm", "a train journey", "a garden in spring",
    "a lost key", "the desert", "a rainy Monday", "a friendly robot", "the stars", "a small boat",
]
PRODUCTS = ["a steel water bottle", "a pair of running shoes", "a desk lamp", "a backpack", "a wool scarf", "a coffee grinder", "a notebook", "a pair of headphones"]
RECIPIENTS = ["my manager", "a colleague", "my landlord", "a customer", "my teacher", "the team"]
EMAIL_MATTERS = ["a delayed report", "a meeting next week", "a broken heater", "a late delivery", "a day off", "a project update"]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Keep answers short.",
    "You are a friendly tutor who explains things step by step.",
    "You are an expert programmer and a careful writer.",
]
FOLLOW_UPS = [
    ("Can you explain that more simply?", "simpler"),
    ("Please summarize your answer in one sentence.", "summary"),
    ("Are you sure about that?", "check"),
    ("Thanks! That was helpful.", "thanks"),
]


def _turn(user: str, reasoning: str, answer: str, subject: str, short: str) -> dict:
    return {"user": user, "reasoning": reasoning, "answer": answer, "subject": subject, "short": short}


def _math_turn(rng: random.Random) -> dict:
    kind = rng.choice(["add", "mul", "sub", "equation", "percent"])
    if kind == "add":
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        q = rng.choice(["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}."]).format(a=a, b=b)
        r = f"The user wants the sum of {a} and {b}.\n{a} + {b} = {a + b}.\nSo the answer is {a + b}."
        return _turn(q, r, f"{a} + {b} = {a + b}\n\nThe answer is **{a + b}**.", f"the sum of {a} and {b}", f"{a} + {b} = {a + b}.")
    if kind == "sub":
        a, b = rng.randint(50, 999), rng.randint(1, 49)
        q = rng.choice(["What is {a} - {b}?", "What is {a} minus {b}?", "Subtract {b} from {a}."]).format(a=a, b=b)
        r = f"The user wants the difference of {a} and {b}.\n{a} - {b} = {a - b}.\nSo the answer is {a - b}."
        return _turn(q, r, f"{a} - {b} = {a - b}\n\nThe answer is **{a - b}**.", f"{a} minus {b}", f"{a} - {b} = {a - b}.")
    if kind == "mul":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        q = rng.choice(["What is {a} times {b}?", "Multiply {a} by {b}.", "Compute {a} * {b}.", "What is the product of {a} and {b}?"]).format(a=a, b=b)
        r = f"The user wants the product of {a} and {b}.\n{a} * {b} = {a * b}.\nSo the answer is {a * b}."
        return _turn(q, r, f"{a} * {b} = {a * b}\n\nThe answer is **{a * b}**.", f"the product of {a} and {b}", f"{a} * {b} = {a * b}.")
    if kind == "equation":
        a, x, b = rng.randint(2, 12), rng.randint(1, 20), rng.randint(1, 50)
        c = a * x + b
        q = rng.choice(["Solve for x: {a}x + {b} = {c}.", "Find x if {a}x + {b} = {c}.", "What value of x satisfies {a}x + {b} = {c}?"]).format(a=a, b=b, c=c)
        r = (f"The user wants to solve {a}x + {b} = {c}.\nSubtract {b} from both sides: {a}x = {c - b}.\n"
             f"Divide both sides by {a}: x = {x}.")
        ans = f"Subtract {b} from both sides: {a}x = {c - b}.\nDivide by {a}: x = {x}.\n\nCheck: {a} * {x} + {b} = {c}. So **x = {x}**."
        return _turn(q, r, ans, f"the equation {a}x + {b} = {c}", f"x = {x}.")
    p, n = rng.choice([10, 20, 25, 50, 75]), rng.choice([40, 80, 120, 200, 360, 400, 1000])
    v = p * n // 100
    q = rng.choice(["What is {p}% of {n}?", "Calculate {p} percent of {n}.", "How much is {p}% of {n}?"]).format(p=p, n=n)
    r = f"The user wants {p}% of {n}.\n{p}% means {p}/100.\n{n} * {p} / 100 = {v}."
    return _turn(q, r, f"{p}% of {n} is {n} * {p} / 100 = {v}.\n\nThe answer is **{v}**.", f"{p}% of {n}", f"{p}% of {n} is {v}.")


def _code_turn(rng: random.Random) -> dict:
    task, fname, code = rng.choice(CODE_TASKS)
    if rng.random() < 0.25:
        q = rng.choice(["Explain what this code does:\n```python\n{code}\n```", "What does this Python function do?\n\n{code}"]).format(code=code)
        r = f"The user shows a function named `{fname}`.\nReading the body, it {task}.\nI will explain it in one paragraph."
        ans = f"The function `{fname}` {task}.\n\nIt takes its input, processes it step by step and returns the result."
        return _turn(q, r, ans, f"the function `{fname}`", f"`{fname}` {task}.")
    q = rng.choice([
        "Write a Python function that {task}.", "Can you show me Python code that {task}?",
        "Implement a function in Python which {task}.", "I need a Python function that {task}. Can you help?",
    ]).format(task=task)
    r = f"The user wants a Python function that {task}.\nI will call it `{fname}` and keep it short.\nThen I will explain how it works."
    ans = f"Here is a function that {task}:\n\n```python\n{code}\n```\n\nThe function `{fname}` {task} and returns the result."
    return _turn(q, r, ans, f"a Python function that {task}", f"`{fname}` {task}.")


def _writing_turn(rng: random.Random) -> dict:
    kind = rng.choice(["haiku", "poem", "story", "product", "email"])
    if kind in ("haiku", "poem", "story"):
        s = rng.choice(SUBJECTS)
        if kind == "haiku":
            q = rng.choice(["Write a haiku about {s}.", "Compose a haiku on {s}.", "Can you write me a haiku about {s}?"]).format(s=s)
            r = f"The user wants a haiku about {s}.\nA haiku has three lines of five, seven and five syllables.\nI will describe {s} with one clear image."
            ans = f"Here is a haiku about {s}:\n\nQuiet {s} waits,\nsoft light moves across the hours,\nthe day breathes slowly."
        elif kind == "poem":
            q = rng.choice(["Write a short poem about {s}.", "Write four lines of poetry about {s}.", "I would like a little poem about {s}."]).format(s=s)
            r = f"The user wants a short poem about {s}.\nI will write four rhyming lines.\nEach line will show a different detail of {s}."
            ans = (f"Here is a short poem about {s}:\n\nI think of {s} when the evening is near,\nits colours and sounds are gentle and clear,\n"
                   f"it asks for nothing and gives me a song,\nand {s} stays with me all the night long.")
        else:
            q = rng.choice(["Write a two-sentence story about {s}.", "Tell me a very short story about {s}."]).format(s=s)
            r = f"The user wants a very short story about {s}.\nI will use two sentences: a setting and a twist.\nThe twist will be gentle."
            ans = f"Every morning I walked past {s} without looking. Today I stopped, and {s} was the only thing that remembered my name."
        return _turn(q, r, ans, s, f"a short piece about {s}.")
    if kind == "product":
        p = rng.choice(PRODUCTS)
        q = rng.choice(["Write a product description for {p}.", "Describe {p} for an online shop.", "Give me a short sales text for {p}."]).format(p=p)
        r = f"The user wants a product description for {p}.\nI will name three benefits and end with a call to action.\nThe tone should be friendly."
        ans = (f"Meet {p}, made for everyday life.\n\n- **Durable:** built to last for years.\n- **Comfortable:** easy to use every day.\n"
               f"- **Simple:** no extra parts, no fuss.\n\nOrder {p} today and feel the difference.")
        return _turn(q, r, ans, p, f"{p} is durable, comfortable and simple.")
    who, what = rng.choice(RECIPIENTS), rng.choice(EMAIL_MATTERS)
    q = rng.choice(["Write an email to {who} about {what}.", "Draft a polite email to {who} about {what}.", "Help me write a short email to {who} regarding {what}."]).format(who=who, what=what)
    r = f"The user wants an email to {who} about {what}.\nI will keep it polite and short: greeting, the point, a request, a closing.\nI will use a clear subject line."
    ans = (f"Subject: About {what}\n\nHello,\n\nI am writing to you about {what}. I would be grateful if we could talk about it this week.\n"
           f"Please let me know what time works for you.\n\nBest regards")
    return _turn(q, r, ans, f"an email about {what}", f"a polite email about {what}.")


def _facts_turn(rng: random.Random) -> dict:
    kind = rng.choice(["capital", "concept", "animal"])
    if kind == "capital":
        country = rng.choice(sorted(CAPITALS))
        city = CAPITALS[country]
        q = rng.choice(["What is the capital of {c}?", "Which city is the capital of {c}?", "Tell me the capital of {c}.", "What's {c}'s capital city?"]).format(c=country)
        r = f"The user asks for the capital of {country}.\nThe capital of {country} is {city}."
        return _turn(q, r, f"The capital of {country} is **{city}**.", f"the capital of {country}", f"The capital of {country} is {city}.")
    if kind == "concept":
        name = rng.choice(sorted(CONCEPTS))
        meaning = CONCEPTS[name]
        q = rng.choice(["What is {n}?", "Explain {n} in simple terms.", "Can you tell me what {n} is?", "Define {n}."]).format(n=name)
        r = f"The user wants to know about {name}.\nIn short, it is {meaning}.\nI will give the definition and one example."
        ans = f"In short, {name} is {meaning}.\n\nFor example, you can see {name} at work in everyday life once you know what to look for."
        return _turn(q, r, ans, name, f"{name} is {meaning}.")
    animal = rng.choice(sorted(ANIMALS))
    fact = ANIMALS[animal]
    q = rng.choice(["Tell me an interesting fact about the {a}.", "What is special about the {a}?", "Give me a fun fact about the {a}."]).format(a=animal)
    r = f"The user wants a fact about the {animal}.\nA well-known fact: the {animal} {fact}."
    return _turn(q, r, f"Here is a fun fact: the {animal} {fact}.", f"the {animal}", f"The {animal} {fact}.")


def _reasoning_turn(rng: random.Random) -> dict:
    kind = rng.choice(["items", "order", "weight"])
    if kind == "items":
        n1, n2 = rng.sample(NAMES, 2)
        item = rng.choice(ITEMS)
        a, b = rng.randint(3, 30), rng.randint(1, 20)
        c = rng.randint(1, a + b)
        left = a + b - c
        q = (f"{n1} has {a} {item}s and buys {b} more. Then {n1} gives {c} {item}s to {n2}. "
             f"How many {item}s does {n1} have now?")
        r = f"Start: {n1} has {a} {item}s.\nAfter buying {b}: {a} + {b} = {a + b}.\nAfter giving {c} to {n2}: {a + b} - {c} = {left}."
        ans = f"1. {n1} starts with {a} {item}s.\n2. After buying {b} more: {a + b}.\n3. After giving {c} away: {left}.\n\n{n1} has **{left}** {item}s now."
        return _turn(q, r, ans, f"{n1}'s {item}s", f"{n1} has {left} {item}s.")
    if kind == "order":
        n1, n2, n3 = rng.sample(NAMES, 3)
        q = rng.choice(["{a} is older than {b}, and {b} is older than {c}. Who is the youngest?",
                        "If {a} is older than {b} and {b} is older than {c}, who is youngest?"]).format(a=n1, b=n2, c=n3)
        r = f"{n1} is older than {n2}.\n{n2} is older than {n3}.\nSo the order from oldest to youngest is {n1}, {n2}, {n3}."
        ans = f"The order from oldest to youngest is {n1}, {n2}, {n3}.\n\nSo the youngest is **{n3}**."
        return _turn(q, r, ans, f"the ages of {n1}, {n2} and {n3}", f"{n3} is the youngest.")
    x, y = rng.sample(["feathers", "iron", "sand", "water", "cotton", "stone", "sugar", "wood"], 2)
    q = f"Which is heavier, a kilogram of {x} or a kilogram of {y}?"
    r = f"Both amounts are one kilogram.\nA kilogram of {x} and a kilogram of {y} have the same mass.\nThe material does not matter."
    ans = f"They weigh the same. A kilogram of {x} and a kilogram of {y} are both **one kilogram**."
    return _turn(q, r, ans, f"a kilogram of {x} and of {y}", f"They both weigh one kilogram.")


def _follow_up_turn(rng: random.Random, prev: dict, used: set) -> dict:
    text, kind = rng.choice([f for f in FOLLOW_UPS if f[1] not in used])
    used.add(kind)
    s, short = prev["subject"], prev["short"]
    if kind == "simpler":
        r = f"The user wants a simpler explanation of {s}.\nI will use one plain sentence."
        return _turn(text, r, f"Sure. In simple words: {short}", s, short)
    if kind == "summary":
        r = f"The user wants a one-sentence summary about {s}.\nThe key point is: {short}"
        return _turn(text, r, f"In one sentence: {short}", s, short)
    if kind == "check":
        r = f"The user asks me to check my answer about {s}.\nI check it again: {short}\nIt is correct."
        return _turn(text, r, f"Yes. I checked it again: {short}", s, short)
    r = f"The user thanks me for the answer about {s}.\nI will reply briefly and offer more help."
    return _turn(text, r, f"You're welcome! Let me know if you have more questions about {s}.", s, short)


CATEGORIES = {"math": _math_turn, "code": _code_turn, "writing": _writing_turn, "facts": _facts_turn, "reasoning": _reasoning_turn}


def make_conversation(rng: random.Random) -> dict:
    """One synthetic conversation: {"category", "system" (str|None), "turns": [turn, ...]}."""
    category = rng.choice(sorted(CATEGORIES) + ["multi-turn"])
    turns = [CATEGORIES[rng.choice(sorted(CATEGORIES))](rng) if category == "multi-turn" else CATEGORIES[category](rng)]
    if category == "multi-turn":
        used: set = set()
        for _ in range(rng.choice([1, 1, 2])):
            turns.append(_follow_up_turn(rng, turns[-1], used))
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.2 else None
    return {"category": category, "system": system, "turns": turns}


def conversation_messages(conv: dict) -> list[dict]:
    """Chat messages (role, content, and reasoning on assistant turns) of a synthetic conversation."""
    messages = [{"role": "system", "content": conv["system"]}] if conv["system"] else []
    for t in conv["turns"]:
        messages.append({"role": "user", "content": t["user"]})
        messages.append({"role": "assistant", "content": t["answer"], "reasoning": t["reasoning"]})
    return messages


def training_conversations(n: int = CORPUS_CONVERSATIONS, seed: int = 0) -> list[list[dict]]:
    """The deterministic training corpus of the tiny target: n conversations as message lists."""
    rng = random.Random(f"tiny-target-corpus-{seed}")
    return [conversation_messages(make_conversation(rng)) for _ in range(n)]


def sample_prompt_rows(n: int = 400, seed: int = 0) -> list[dict]:
    """Rows of the embedded sample dataset, in a mix of ShareGPT and OpenAI shapes.

    About half the rows are ShareGPT (`conversations`/`from`/`value`, with an `id`, most with the
    reference assistant answers), half OpenAI (`messages`/`role`/`content`, prompts only; a few
    with content given as a list of text parts). Multi-turn rows and system prompts included.
    """
    rng = random.Random(f"sample-prompts-{seed}")
    rows = []
    for i in range(n):
        conv = make_conversation(rng)
        if rng.random() < 0.5:
            with_answers = len(conv["turns"]) > 1 or rng.random() < 0.6
            turns = [{"from": "system", "value": conv["system"]}] if conv["system"] else []
            for t in conv["turns"]:
                turns.append({"from": rng.choice(["human", "human", "user"]), "value": t["user"]})
                if with_answers:
                    turns.append({"from": "gpt", "value": t["answer"]})
            rows.append({"id": f"sample-{i:04d}", "category": conv["category"], "conversations": turns})
        else:
            messages = [{"role": "system", "content": conv["system"]}] if conv["system"] else []
            for j, t in enumerate(conv["turns"]):
                content: Any = t["user"]
                if rng.random() < 0.08:
                    content = [{"type": "text", "text": t["user"]}]
                messages.append({"role": "user", "content": content})
                if j < len(conv["turns"]) - 1:  # later user turns follow an assistant turn
                    messages.append({"role": "assistant", "content": t["answer"]})
            rows.append({"messages": messages, "category": conv["category"]})
    return rows


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def _tokenizer_training_texts(conversations: list[list[dict]]) -> Iterator[str]:
    # Raw message texts (no template markup), so no merge ever spans a special token.
    for messages in conversations:
        for m in messages:
            yield m["role"] + "\n"
            yield m["content"]
            if m.get("reasoning"):
                yield m["reasoning"]


def build_tokenizer(conversations: list[list[dict]], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE trained on the corpus, wrapped as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0..4, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_training_texts(conversations), trainer=trainer)
    # Like Qwen3: the chat markers are special (skipped when decoding with skip_special_tokens),
    # the think markers are ordinary added tokens (kept in decoded text, parsed by reasoning parsers).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[:3]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS[3:]])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=MAX_POSITION_EMBEDDINGS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _portable_tokenizer_config(out: Path) -> None:
    """Make tokenizer_config.json readable by older transformers too (vLLM on a GPU cluster may
    pin 4.x): the generic fast-tokenizer class and the chat template inline."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

def model_config(family: str, vocab_size: int, pad_id: int, eos_id: int):
    """The transformers config of a tiny target of `family`."""
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=MAX_POSITION_EMBEDDINGS, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=pad_id, bos_token_id=None, eos_token_id=eos_id,
        initializer_range=0.02,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, head_dim=32, **common)
        cfg.architectures = ["LlamaForCausalLM"]
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(num_key_value_heads=2, head_dim=32, **common)
        cfg.architectures = ["Qwen3ForCausalLM"]
    elif family == "deepseek_v3":
        # Tiny MLA + MoE: layer 0 dense, layers 1-3 with 8 routed experts (2 per token) + 1 shared.
        # The latent cache keeps DeepSeek-V3's real width, kv_lora_rank 512 + rope 64 = 576: vLLM's CPU
        # MLA kernel is compiled for that size only (cpu_mla.py get_supported_head_sizes).
        cfg = transformers.DeepseekV3Config(
            num_key_value_heads=4, moe_intermediate_size=64, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
            kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, num_mtp_layers=0,
            # What DeepSeek-V3's own config.json says and transformers implements (sigmoid router with a
            # correction bias); vLLM reads these two keys to build the same router (else it has no bias).
            topk_method="noaux_tc", scoring_func="sigmoid",
            **common,
        )
        cfg.architectures = ["DeepseekV3ForCausalLM"]
    else:
        raise ValueError(f"unknown tiny target family '{family}'; choose one of {', '.join(FAMILIES)}")
    return cfg


def default_steps(family: str) -> int:
    return DEEPSEEK_STEPS if family == "deepseek_v3" else DEFAULT_STEPS


def _token_stream(tokenizer, conversations: list[list[dict]]) -> list[int]:
    """All conversations rendered with the chat template, separated by <|endoftext|>."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for messages in conversations:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eot)
    return ids


def train_model(model, stream: list[int], *, steps: int, seed: int = 0, batch_size: int = DEFAULT_BATCH_SIZE,
                seq_len: int = DEFAULT_SEQ_LEN, lr: float = DEFAULT_LR, progress: bool = True) -> list[float]:
    """Plain AdamW next-token training on random windows of `stream`; returns the loss of every step."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    data = torch.tensor(stream, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, min(50, steps // 10))
    model.train()
    losses = []
    bar = tqdm(range(steps), desc="train tiny target", disable=not progress, mininterval=2.0)
    for step in bar:
        # Linear warmup, then cosine decay to 10% of the peak.
        frac = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        for group in opt.param_groups:
            group["lr"] = lr * frac
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        window = torch.stack([data[s: s + seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=window[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    return losses


def training_threads() -> int:
    """2 threads on an idle machine, 1 when it is busy: with more runnable threads than cores,
    OpenMP spin-waiting makes 2 threads several times slower than 1 (measured here). The
    result does not depend on it (1 and 2 threads gave bit-identical weights here).
    EAGLE3_TINY_THREADS overrides."""
    if os.environ.get("EAGLE3_TINY_THREADS"):
        return max(1, int(os.environ["EAGLE3_TINY_THREADS"]))
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return 2 if cores >= 2 and busy + 2 <= cores + 0.5 else 1


@contextlib.contextmanager
def _torch_threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_tiny_target(out_dir: str | os.PathLike, family: str = "llama", train: bool | None = None, steps: int | None = None,
                      seed: int = 0, dtype: str = "float32", num_conversations: int = CORPUS_CONVERSATIONS,
                      progress: bool = True) -> dict:
    """Build a tiny target into `out_dir` (created; existing files are overwritten). Returns build info.

    train: None = train (every family).
    steps: training steps (None = default_steps(family)). Deterministic for a given (family, steps, seed).
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny target family '{family}'; choose one of {', '.join(FAMILIES)}")
    train = True if train is None else train
    steps = default_steps(family) if steps is None else steps
    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    conversations = training_conversations(num_conversations, seed=seed)
    tokenizer = build_tokenizer(conversations)
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = model_config(family, len(tokenizer), pad_id, eos_id)

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    info: dict[str, Any] = {"family": family, "seed": seed, "trained": bool(train), "steps": steps if train else 0,
                            "num_parameters": sum(p.numel() for p in model.parameters())}
    if train and steps > 0:
        stream = _token_stream(tokenizer, conversations)
        threads, t_train = training_threads(), time.time()
        with _torch_threads(threads):
            losses = train_model(model, stream, steps=steps, seed=seed, progress=progress)
        tail = losses[-min(20, len(losses)):]
        info.update(corpus_tokens=len(stream), first_loss=losses[0], final_loss=sum(tail) / len(tail),
                    train_threads=threads, train_seconds=round(time.time() - t_train, 1))

    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=None, do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out)
    info["build_seconds"] = round(time.time() - t0, 1)
    (out / "tiny_target_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------

def cache_root_dir(cache_root: str | os.PathLike | None = None) -> Path:
    base = cache_root or os.environ.get("EAGLE3_CACHE") or Path.home() / ".cache" / "eagle3-pipeline"
    return Path(base).expanduser() / "tiny-targets"


def build_key(family: str, train: bool | None = None, steps: int | None = None, seed: int = 0) -> str:
    """`<family>-<hash>`: the hash covers this file (builder + corpus), the parameters and library versions."""
    import tokenizers
    import torch
    import transformers

    train = True if train is None else train
    steps = default_steps(family) if steps is None else steps
    h = hashlib.sha256(Path(__file__).read_bytes())
    params = {"family": family, "train": train, "steps": steps if train else 0, "seed": seed,
              "versions": [torch.__version__, transformers.__version__, tokenizers.__version__]}
    h.update(json.dumps(params, sort_keys=True).encode())
    return f"{family}-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_tiny_target(family: str = "llama", cache_root: str | os.PathLike | None = None, *, train: bool | None = None,
                       steps: int | None = None, seed: int = 0, progress: bool = True) -> Path:
    """The cached tiny target of `family`, built on first use. Safe when processes race.

    The build happens in a temp dir next to the final one, renamed into place when complete;
    a lock file keeps a second process from building the same thing at the same time.
    """
    root = cache_root_dir(cache_root)
    key = build_key(family, train, steps, seed)
    final = root / key
    if (final / "tiny_target_info.json").is_file():
        return final
    with _file_lock(root / f".{key}.lock"):
        if (final / "tiny_target_info.json").is_file():  # another process finished while we waited
            return final
        for stale in root.glob(f".tmp-{key}-*"):  # left by a build that crashed
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # incomplete (not made by this function): rebuild
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        try:
            info = build_tiny_target(tmp, family=family, train=train, steps=steps, seed=seed, progress=progress)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "tiny_target_info.json").is_file():
                    raise
                # Someone without the lock (another filesystem) won the race: keep theirs.
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"tiny target {family}: built {final} in {info['build_seconds']:.0f}s", file=sys.stderr)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.demo.tiny_target", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--out", help="build into this directory (always builds)")
    parser.add_argument("--print-path", action="store_true", help="build into the cache if needed and print its path")
    parser.add_argument("--cache-root", help="cache base directory (default: $EAGLE3_CACHE or ~/.cache/eagle3-pipeline)")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {DEFAULT_STEPS}, deepseek_v3 {DEEPSEEK_STEPS})")
    parser.add_argument("--no-train", action="store_true", help="keep the random initialisation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train = False if args.no_train else None
    if args.out:
        info = build_tiny_target(args.out, family=args.family, train=train, steps=args.steps, seed=args.seed)
        print(json.dumps(info))
        return 0
    if not args.print_path:
        parser.error("pass --out DIR or --print-path")
    print(ensure_tiny_target(args.family, args.cache_root, train=train, steps=args.steps, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
