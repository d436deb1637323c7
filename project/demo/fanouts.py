"""Example definitions: make a thumbnail of every image, through a pool of 3 thumbnailers."""

import random
import time

from fanout import FanOut, Item, PermanentError


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
