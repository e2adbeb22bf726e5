"""A paraphrase retrieval set, generated deterministically: the embedded default text data.

Each item is a household object with four attributes (object, colour, material, room). Its document
states them in plain words ("The red wooden chair is kept in the kitchen."); its query asks for the same
item in other words, synonyms in another sentence form ("Which crimson seat made of timber is in the
cooking area?"). Items that share three of four attributes are the hard distractors, so a model must
match every attribute through its paraphrase. Train and test use disjoint items and disjoint query
sentence forms; everything derives from a seed and nothing is downloaded.

>>> train, test = paraphrase_split(num_train=512, num_test=256, seed=0)
>>> train[0]     # (query, document)
"""

from __future__ import annotations

import itertools
import random

# canonical word (documents) -> paraphrases (queries)
OBJECTS = {"chair": ("seat", "stool"), "lamp": ("light", "lantern"), "box": ("crate", "container"),
           "bottle": ("flask", "jar"), "knife": ("blade", "cutter"), "bag": ("sack", "pouch"),
           "clock": ("timepiece", "wall watch"), "table": ("desk", "bench"), "cup": ("mug", "beaker"),
           "basket": ("hamper", "crate for fruit")}
COLOURS = {"red": ("crimson", "scarlet"), "blue": ("azure", "navy"), "green": ("emerald", "olive"),
           "yellow": ("golden", "amber"), "black": ("jet-black", "dark"), "white": ("snowy", "ivory"),
           "brown": ("chocolate", "tan"), "grey": ("silver", "ash-coloured")}
MATERIALS = {"wooden": ("timber", "oak"), "metal": ("steel", "iron"), "glass": ("crystal", "clear glass"),
             "plastic": ("synthetic polymer", "vinyl"), "leather": ("hide", "tanned skin"),
             "stone": ("marble", "granite"), "paper": ("cardboard", "card")}
ROOMS = {"kitchen": ("cooking area", "cookhouse"), "garage": ("car shed", "carport"),
         "bedroom": ("sleeping room", "bedchamber"), "garden": ("yard", "backyard"),
         "office": ("study", "workroom"), "attic": ("loft", "roof space"), "basement": ("cellar", "vault"),
         "hallway": ("corridor", "entrance hall")}

DOCUMENT = "The {colour} {material} {obj} is kept in the {room}."
# query forms: o object, c colour, m material (a noun: "made of ..."), r room
TRAIN_FORMS = ("Which {c} {o} made of {m} is in the {r}?", "I am looking for the {o} of {m} in the {r}; it is {c}.",
               "In the {r} there is a {c} {o}, made of {m}.", "Find the {m} {o} that is {c}, stored in the {r}.")
TEST_FORMS = ("Where is the {c} {o} of {m}? It should be in the {r}.", "The {r} holds a {o} of {m}, colour {c}.")


def _items() -> list[tuple[str, str, str, str]]:
    return list(itertools.product(OBJECTS, COLOURS, MATERIALS, ROOMS))


def pair(item: tuple[str, str, str, str], rng: random.Random, forms: tuple[str, ...]) -> tuple[str, str]:
    """(query, document) of one item, the query's paraphrases and form drawn from rng."""
    obj, colour, material, room = item
    document = DOCUMENT.format(colour=colour, material=material, obj=obj, room=room)
    query = rng.choice(forms).format(o=rng.choice(OBJECTS[obj]), c=rng.choice(COLOURS[colour]),
                                     m=rng.choice(MATERIALS[material]), r=rng.choice(ROOMS[room]))
    return query[0].upper() + query[1:], document


def paraphrase_split(num_train: int = 1024, num_test: int = 256, seed: int = 0):
    """(train, test): lists of (query, document) pairs over disjoint items (of the 4480), test queries in
    sentence forms that training never shows."""
    items = _items()
    if num_train + num_test > len(items):
        raise ValueError(f"num_train + num_test must be at most {len(items)} items, got {num_train + num_test}")
    rng = random.Random(seed)
    rng.shuffle(items)
    train = [pair(item, rng, TRAIN_FORMS) for item in items[:num_train]]
    test = [pair(item, rng, TEST_FORMS) for item in items[num_train:num_train + num_test]]
    return train, test
