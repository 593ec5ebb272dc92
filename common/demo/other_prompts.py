"""A prompt set of another kind than the training data, for measuring how the draft generalises.

The tiny target's training corpus and the sample prompts (common.demo.chat_corpus) are short templated
questions about arithmetic, small Python functions, poems/emails/product blurbs, capitals, concepts,
animals and word puzzles. These prompts share none of that: other topics (cooking, travel, sport,
music, history, household money, gardening, health), other formats (JSON, tables, numbered plans,
rewriting or summarising a pasted passage, role play, one-word prompts) and other lengths (from two
words to a ~250-word pasted text). 05 sends them next to the held-out prompts
(`evaluate.other_prompts`: the prompt set named "other", beside any `evaluate.prompt_sets`); they are
never a `data.source`, and 05 refuses a set that shares a prompt with the training prompts.

This lives apart from common/demo/chat_corpus.py on purpose: the tiny target's cache key hashes that file
(and tiny_target.py), so adding these there would rebuild every cached target. Written to data/other_prompts.jsonl by
`python scripts/make_sample_data.py --other`.
"""

from __future__ import annotations

import hashlib
import json
import random

DISHES = ["a vegetable curry", "banana bread", "a mushroom risotto", "pancakes for four", "a lentil soup", "fried rice"]
CITIES = ["Lisbon", "Kyoto", "Marrakesh", "Reykjavik", "Cape Town", "Vancouver", "Hanoi", "Edinburgh"]
SPORTS = ["tennis", "rowing", "rock climbing", "basketball", "cross-country skiing", "table tennis"]
INSTRUMENTS = ["the cello", "the ukulele", "the drums", "the trumpet", "the harp"]
EVENTS = ["the printing press", "the first moon landing", "the fall of the Berlin Wall", "the Silk Road", "the Industrial Revolution"]
PLANTS = ["tomatoes", "basil", "a lemon tree", "orchids", "strawberries", "lavender"]
HABITS = ["sleeping better", "drinking more water", "stretching at a desk", "walking every day"]
BUDGET_ITEMS = ["rent", "groceries", "transport", "phone", "savings", "eating out", "gym"]

PASSAGE = (
    "The town council met on Tuesday evening to discuss the future of the old railway station. The building, "
    "which has stood empty for almost twenty years, was once the busiest stop on the northern line, and many "
    "residents still remember queuing on its wooden platforms. Three proposals were presented. The first, from a "
    "local housing association, would turn the main hall into forty small apartments while keeping the clock tower "
    "and the iron roof. The second, backed by a group of artists, imagines a covered market with workshops, a "
    "cafe and a stage for weekend concerts. The third proposal is the simplest: repair the roof, clean the "
    "facade and sell the site to the highest bidder, using the money to fund road repairs elsewhere in town. "
    "Supporters of the housing plan argued that young families are leaving because rents are too high. The "
    "artists replied that a lively market would bring visitors and jobs, and that the station belongs to "
    "everyone. Several older residents asked the council not to rush, pointing out that the last sale of a public "
    "building ended with a car park nobody wanted. After two hours of debate the council agreed to hold a public "
    "vote in the spring and to publish the full cost of each plan before then. The mayor thanked everyone for "
    "coming and said the turnout showed how much the station still means to the town."
)


def _cooking(rng):
    dish = rng.choice(DISHES)
    return rng.choice([
        f"Give me a recipe for {dish} as JSON with the keys \"ingredients\" (a list) and \"steps\" (a list).",
        f"I have 30 minutes and a small kitchen. How do I make {dish}? Number the steps.",
        f"What can I use instead of eggs when baking {dish}?",
    ])


def _travel(rng):
    a, b = rng.sample(CITIES, 2)
    days = rng.randint(2, 6)
    return rng.choice([
        f"Plan a {days}-day trip to {a}. Use a table with the columns Day, Morning, Afternoon, Evening.",
        f"Compare {a} and {b} for a family holiday in winter: weather, costs and things to do.",
        f"What should I pack for a week in {a} in October? A bullet list, please.",
    ])


def _sport(rng):
    sport = rng.choice(SPORTS)
    return rng.choice([
        f"Explain the basic rules of {sport} to a ten-year-old.",
        f"Write an eight-week beginner training plan for {sport}, one line per week.",
        f"Which muscles does {sport} use the most?",
    ])


def _music(rng):
    instrument = rng.choice(INSTRUMENTS)
    return rng.choice([
        f"I am 45 and want to learn {instrument}. Where do I start?",
        f"Describe the sound of {instrument} to someone who has never heard it.",
    ])


def _history(rng):
    event = rng.choice(EVENTS)
    return rng.choice([
        f"Tell me the story of {event} in three short paragraphs.",
        f"List five consequences of {event}, most important first.",
        f"Why does {event} still matter today?",
    ])


def _money(rng):
    items = rng.sample(BUDGET_ITEMS, 4)
    income = rng.choice([1800, 2400, 3100, 4200])
    return (f"My monthly income is {income} euros. Split it into a budget for {', '.join(items[:-1])} and {items[-1]}, "
            f"and return it as a markdown table with amounts and percentages.")


def _garden(rng):
    plant = rng.choice(PLANTS)
    return rng.choice([
        f"How often should I water {plant} on a sunny balcony?",
        f"The leaves of my {plant} are turning yellow. What could be wrong?",
    ])


def _health(rng):
    habit = rng.choice(HABITS)
    return rng.choice([
        f"Give me three practical tips for {habit}.",
        f"Write a friendly reminder message about {habit} that I can put on my fridge.",
    ])


def _pasted_text(rng):
    return rng.choice([
        f"Summarize the following news article in two sentences.\n\n{PASSAGE}",
        f"Rewrite this text for a children's newspaper, in simple words:\n\n{PASSAGE}",
        f"Here is a report from a council meeting:\n\n{PASSAGE}\n\nWhat are the three proposals? Answer as a numbered list.",
    ])


def _role_play(rng):
    city = rng.choice(CITIES)
    return rng.choice([
        f"Pretend you are a tour guide in {city}. Greet a group of tourists and introduce the day.",
        "You are a ship's captain in a storm. Give orders to your crew.",
    ])


def _tiny(rng):
    return rng.choice(["hello", "ok", "Tell me a joke.", "why?", "recipe?", "Good morning!"])


FAMILIES = {"cooking": _cooking, "travel": _travel, "sport": _sport, "music": _music, "history": _history,
            "money": _money, "garden": _garden, "health": _health, "pasted_text": _pasted_text,
            "role_play": _role_play, "tiny": _tiny}


def other_prompt_rows(n: int = 48, seed: int = 1234) -> list[dict]:
    """n distinct prompts, families in turn, as {"id", "kind", "messages"} rows (OpenAI shape)."""
    rng = random.Random(seed)
    names = list(FAMILIES)
    rows, seen = [], set()
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n:
            raise ValueError(f"only {len(rows)} distinct other-kind prompts could be generated; ask for fewer than {n}")
        kind = names[attempts % len(names)]
        text = FAMILIES[kind](rng)
        if text in seen:
            continue
        seen.add(text)
        messages = [{"role": "user", "content": text}]
        rid = "other-" + hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:12]
        rows.append({"id": rid, "kind": kind, "messages": messages})
    return rows
