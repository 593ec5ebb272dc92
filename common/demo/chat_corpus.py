"""The synthetic chat corpus of the tiny target (common.demo.tiny_target), and the embedded sample dataset.

Every generator returns one turn: the user text, the assistant's reasoning and answer, plus a subject and
a short summary that follow-up turns refer to. Answers are fixed templates of the question's slots, so a
tiny model can learn them: templated questions (math, code, writing, facts, reasoning, multi-turn) with
structured answers that start with a reasoning part.

- `make_conversation`, `conversation_messages`: one seeded conversation, and its chat messages
  (common.demo.tiny_target.training_conversations trains the tiny target on them).
- `sample_prompt_rows`: data/sample_prompts.jsonl (scripts/make_sample_data.py) from the same generator,
  so the prompts the embedded pipeline sends are in the target's distribution.

The tiny target's cache key hashes this file with tiny_target.py: a change here rebuilds it once.
"""

from __future__ import annotations

import random
from typing import Any

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
    return _turn(q, r, ans, f"a kilogram of {x} and of {y}", "They both weigh one kilogram.")


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
