"""Example definitions: make a thumbnail of every image, through a pool of 3 thumbnailers."""

import random
import time

from fanout import FanOut, Item, PermanentError, Throttled


def images(params: dict) -> list[dict]:
    """The work list: a deterministic set of fake images."""
    return [{"name": f"photo-{n:04d}.jpg", "size": 800 + 37 * n} for n in range(params["count"])]


def make_thumbnail(item: Item) -> dict:
    # Pretend to work: a provider call of 50-150 ms.
    rng = random.Random(f"{item.key}:{item.attempt}")
    time.sleep(rng.uniform(0.05, 0.15))
    if item.index % 29 == 7:
        raise PermanentError(f"{item.payload['name']} is not an image")
    if item.attempt == 1 and item.index % 11 == 3:
        raise ConnectionError("thumbnail service hiccup (will be retried)")
    return {
        "thumbnail": item.payload["name"].replace(".jpg", "_thumb.jpg"),
        "bytes": item.payload["size"] // 10,
    }


def summarize(outcomes) -> dict:
    made = [o.result["thumbnail"] for o in outcomes if o.succeeded]
    return {"thumbnails": len(made), "first": made[:3]}


thumbnails = FanOut(
    "thumbnails",
    over=images,
    key=lambda image: image["name"],
    do=make_thumbnail,
    pool="thumbnailer",  # FANOUT_POOLS: 3 at once, 20 per second
    max_parallel=6,
    max_attempts=3,
    retry_backoff=0.2,
    failure_policy="tolerate",
    join=summarize,
    params={"count": (int, 60)},
)


# --- A model × prompt × repeat sweep of paid LLM calls, under token rates and budgets ---------
# One pool per provider (FANOUT_POOLS in settings): its rate counts tokens, as the provider's
# limit does, and its budget caps what every run through it spends. Interrupt the sweep and
# run it again: finished cells are not run again, and nothing is spent twice.

MODELS = {  # model: (provider, dollars per token)
    "swift-small": ("llm-acme", 0.000001),
    "swift-large": ("llm-acme", 0.000004),
    "sage-medium": ("llm-orbit", 0.000002),
}
PROMPTS = [f"prompt-{n:02d}" for n in range(8)]
MAX_TOKENS = 300


class FakeProvider:
    """A provider that bills a random number of tokens up to max_tokens and answers 429 past
    its own limit of tokens per second (what a real one does to an unbounded fan-out)."""

    def __init__(self, tokens_per_second: float) -> None:
        import threading

        self.rate = tokens_per_second
        self.tokens = tokens_per_second
        self.at = time.monotonic()
        self.lock = threading.Lock()

    def complete(self, model: str, prompt: str, max_tokens: int, seed: str) -> int:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens < max_tokens:
                raise Throttled(0.5, "429 Too Many Requests")
            self.tokens -= max_tokens
        rng = random.Random(seed)
        time.sleep(rng.uniform(0.02, 0.08))
        return rng.randint(max_tokens // 4, max_tokens)  # the tokens it bills


PROVIDERS = {"llm-acme": FakeProvider(4000), "llm-orbit": FakeProvider(4000)}


def cells(params: dict) -> list[dict]:
    return [
        {"model": model, "prompt": prompt, "repeat": r, "max_tokens": MAX_TOKENS}
        for model in MODELS
        for prompt in PROMPTS
        for r in range(params["repeats"])
    ]


def ask(item: Item) -> dict:
    cell = item.payload
    provider, price = MODELS[cell["model"]]
    billed = PROVIDERS[provider].complete(
        cell["model"], cell["prompt"], cell["max_tokens"], item.idempotency_key
    )
    item.report_cost(tokens=billed, usd=billed * price)
    return {"tokens": billed}


def most(item: Item) -> dict:
    """An upper bound (max_tokens): a budget is then never passed."""
    _, price = MODELS[item.payload["model"]]
    return {"tokens": item.payload["max_tokens"], "usd": item.payload["max_tokens"] * price}


def tally(outcomes) -> dict:
    done = [o for o in outcomes if o.succeeded]
    return {"cells": len(done), "tokens": sum(o.result["tokens"] for o in done)}


llm_sweep = FanOut(
    "llm_sweep",
    over=cells,
    key=lambda cell: f"{cell['model']}/{cell['prompt']}/{cell['repeat']}",
    do=ask,
    pool=lambda item: MODELS[item.payload["model"]][0],
    cost=most,
    max_parallel=8,
    failure_policy="tolerate",
    join=tally,
    params={"repeats": (int, 3)},
)
