"""A seeded generator of English-like text: the demo corpus and the demo sentiment task.

Documents pick a topic (its people, creatures, things, verbs, adjectives and places) and tell of it
in sentences with subject-verb agreement (``the fox sleeps`` / ``two foxes sleep``), pronouns
that agree with the previous subject, questions answered in kind, and reviews whose sentiment
follows from adjectives, negation and ``but``. Only ``random.Random.random()`` is used, whose
stream Python guarantees for a given seed, so the text is the same bytes on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Topic:
    name: str
    agents: tuple[tuple[str, str], ...]  # (singular, plural) nouns that act
    things: tuple[tuple[str, str], ...]  # (singular, plural) nouns acted upon
    adjectives: tuple[str, ...]
    intransitive: tuple[tuple[str, str], ...]  # (third person singular, plural)
    transitive: tuple[tuple[str, str], ...]
    places: tuple[str, ...]


def _pairs(words: str) -> tuple[tuple[str, str], ...]:
    return tuple(tuple(w.split("/")) for w in words.split())  # type: ignore[misc]


def _verbs(words: str) -> tuple[tuple[str, str], ...]:
    return tuple((v + ("es" if v.endswith(("sh", "ch", "s", "x")) else "s"), v) for v in words.split())


def _topic(
    name: str, agents: str, things: str, adjectives: str, intransitive: str, transitive: str, places: str
) -> Topic:
    return Topic(
        name,
        _pairs(agents),
        _pairs(things),
        tuple(adjectives.split()),
        _verbs(intransitive),
        _verbs(transitive),
        tuple(places.split(";")),
    )


TOPICS = (
    _topic(
        "forest",
        "fox/foxes wolf/wolves owl/owls rabbit/rabbits bear/bears squirrel/squirrels badger/badgers",
        "nut/nuts berry/berries mushroom/mushrooms leaf/leaves log/logs nest/nests",
        "quiet wild hungry brown clever shy",
        "sleep hide run wait hunt listen",
        "chase watch follow find avoid carry",
        "in the forest;under the old oak;near the river;behind the hill;in the tall grass",
    ),
    _topic(
        "kitchen",
        "cook/cooks baker/bakers chef/chefs waiter/waiters guest/guests",
        "soup/soups bread/breads cake/cakes onion/onions pot/pots knife/knives",
        "warm sweet salty fresh busy careful",
        "smile rest hurry wait cook",
        "stir cut taste bake wash serve",
        "in the kitchen;at the market;by the oven;at the long table;behind the counter",
    ),
    _topic(
        "space",
        "astronaut/astronauts pilot/pilots robot/robots engineer/engineers scientist/scientists",
        "planet/planets star/stars moon/moons rocket/rockets comet/comets signal/signals",
        "bright distant silver cold brave",
        "float drift land launch work",
        "observe repair launch measure study track",
        "on the station;near the moon;above the clouds;in deep space;at the launch pad",
    ),
    _topic(
        "sea",
        "sailor/sailors fisher/fishers captain/captains diver/divers seal/seals whale/whales",
        "boat/boats wave/waves fish/fishes shell/shells net/nets island/islands",
        "blue deep calm salty strong tired",
        "sail swim dive row rest",
        "pull catch steer clean watch mend",
        "at the harbor;at sea;near the island;on the beach;below the cliffs",
    ),
    _topic(
        "school",
        "teacher/teachers student/students pupil/pupils librarian/librarians",
        "book/books lesson/lessons pencil/pencils map/maps question/questions poem/poems",
        "curious patient tired careful proud",
        "listen read laugh learn wait",
        "explain write read answer study draw",
        "in the classroom;in the library;on the playground;in the hall;at the blackboard",
    ),
    _topic(
        "farm",
        "farmer/farmers horse/horses cow/cows goat/goats hen/hens dog/dogs",
        "field/fields barn/barns fence/fences apple/apples seed/seeds tractor/tractors",
        "green muddy strong gentle early",
        "work graze rest eat wander",
        "plant feed fix harvest pull guard",
        "on the farm;in the field;behind the barn;near the pond;by the fence",
    ),
    _topic(
        "music",
        "singer/singers drummer/drummers pianist/pianists fan/fans dancer/dancers",
        "song/songs drum/drums piano/pianos guitar/guitars concert/concerts melody/melodies",
        "loud soft happy famous nervous",
        "sing dance play rehearse bow",
        "play hear practice compose tune record",
        "on the stage;in the studio;at the festival;in the old theater;at the concert hall",
    ),
)
PEOPLE = (
    "Anna",
    "Ben",
    "Clara",
    "David",
    "Emma",
    "Felix",
    "Grace",
    "Hugo",
    "Iris",
    "Jonas",
    "Kate",
    "Leo",
    "Maya",
    "Noah",
)
NUMBERS = ("two", "three", "four", "five", "many", "some")
TIMES = ("at night", "in the morning", "after the rain", "before winter", "every day", "in the evening")
# The sentiment grammar: things reviewed, and adjectives of known polarity.
ITEMS = _pairs("soup/soups film/films hotel/hotels book/books song/songs room/rooms meal/meals show/shows")
POSITIVE = ("good", "great", "wonderful", "lovely", "pleasant", "excellent", "friendly", "delicious")
NEGATIVE = ("bad", "awful", "terrible", "boring", "dull", "poor", "rude", "horrible")
INTENSIFIERS = ("", "", "very ", "really ", "quite ")


class Rng:
    """``random.Random`` reduced to ``random()``, the part whose stream Python keeps stable."""

    def __init__(self, seed: int) -> None:
        self._r = random.Random(seed)

    def random(self) -> float:
        return self._r.random()

    def pick(self, seq: tuple | list) -> object:
        return seq[int(self._r.random() * len(seq))]

    def chance(self, p: float) -> bool:
        return self._r.random() < p

    def between(self, low: int, high: int) -> int:
        """An integer in [low, high]."""
        return low + int(self._r.random() * (high - low + 1))


def _subject(rng: Rng, nouns: tuple[tuple[str, str], ...], topic: Topic, plural: bool) -> str:
    sg, pl = rng.pick(nouns)  # type: ignore[misc]
    adj = rng.pick(topic.adjectives) + " " if rng.chance(0.4) else ""
    if plural:
        return f"{rng.pick(('the', 'the', 'these') + NUMBERS)} {adj}{pl}"
    return f"{rng.pick(('the', 'the', 'a', 'this', 'one'))} {adj}{sg}"


def _fix_article(text: str) -> str:
    return " ".join(
        ("an" if w == "a" and nxt[0] in "aeiou" else w)
        for w, nxt in zip(text.split(), text.split()[1:] + ["x"], strict=True)
    )


def topic_sentence(rng: Rng, topic: Topic, state: dict) -> str:
    """One sentence about ``topic``; ``state["plural"]`` remembers the last subject's number."""
    plural = rng.chance(0.5)
    kind = rng.between(0, 7)
    verb = lambda verbs: rng.pick(verbs)[1 if plural else 0]  # noqa: E731
    if kind == 0:
        s = f"{_subject(rng, topic.agents, topic, plural)} {verb(topic.intransitive)} {rng.pick(topic.places)}"
    elif kind == 1:
        obj = _subject(rng, topic.things, topic, rng.chance(0.5))
        s = f"{_subject(rng, topic.agents, topic, plural)} {verb(topic.transitive)} {obj}"
    elif kind == 2:
        subj = _subject(rng, topic.agents + topic.things, topic, plural)
        s = f"{subj} {'are' if plural else 'is'} {rng.pick(topic.adjectives)}"
    elif kind == 3:
        plural = state.get("plural", False)
        s = f"{'they' if plural else 'it'} {verb(topic.intransitive)} {rng.pick(TIMES)}"
    elif kind == 4:
        sg, pl = rng.pick(topic.things)  # type: ignore[misc]
        s = f"there {'are ' + rng.pick(NUMBERS) + ' ' + pl if plural else 'is a ' + sg} {rng.pick(topic.places)}"
    elif kind == 5:
        plural = False
        s = f"{rng.pick(PEOPLE)} {verb(topic.transitive)} {_subject(rng, topic.things, topic, rng.chance(0.5))}"
    elif kind == 6:
        subj = _subject(rng, topic.agents, topic, plural)
        v = rng.pick(topic.intransitive)[1]  # type: ignore[index]
        yes, does = rng.chance(0.5), "do" if plural else "does"
        answer = f"{'yes' if yes else 'no'}, {'they' if plural else 'it'} {does}{'' if yes else ' not'}"
        s = f"{does} {subj} {v}? {answer.capitalize()}"
    else:
        things_plural = rng.chance(0.5)
        rests = (("stays", "stay"), ("waits", "wait"), ("falls", "fall"))
        rest = rng.pick(rests)[int(things_plural)]  # type: ignore[index]
        s = (
            f"when {_subject(rng, topic.agents, topic, plural)} {verb(topic.intransitive)}, "
            f"{_subject(rng, topic.things, topic, things_plural)} {rest} {rng.pick(topic.places)}"
        )
    state["plural"] = plural
    s = _fix_article(s)
    return s[0].upper() + s[1:] + ("" if s.endswith("?") else ".")


def _clause(rng: Rng, positive: bool) -> str:
    sg, pl = rng.pick(ITEMS)  # type: ignore[misc]
    plural = rng.chance(0.3)
    negate = rng.chance(0.5)
    adj = rng.pick(POSITIVE if positive != negate else NEGATIVE)
    verb = f"{'were' if plural else 'was'} {'not ' if negate else ''}"
    return f"the {pl if plural else sg} {verb}{rng.pick(INTENSIFIERS)}{adj}"


def review(rng: Rng) -> tuple[str, int]:
    """A one-sentence review and its label (1 positive, 0 negative): the polarity of its adjective,
    flipped by ``not``; with ``but``/``although`` the last clause wins, with ``and`` both agree."""
    label = int(rng.chance(0.5))
    form = rng.between(0, 3)
    last = _clause(rng, bool(label))
    if form == 0:
        s = last
    elif form == 1:
        s = f"{_clause(rng, bool(label))} and {last}"
    elif form == 2:
        s = f"{_clause(rng, not label)} but {last}"
    else:
        s = f"although {_clause(rng, not label)}, {last}"
    if rng.chance(0.3):
        s = f"{rng.pick(PEOPLE)} said that {s}"
    return s[0].upper() + s[1:] + ".", label


def document(rng: Rng) -> str:
    """One document: a title sentence naming its topic, then 5-14 sentences (a tenth off-topic)."""
    if rng.chance(0.12):
        sentences = ["Here are some reviews."] + [review(rng)[0] for _ in range(rng.between(4, 10))]
        return " ".join(sentences)
    topic = rng.pick(TOPICS)
    state: dict = {}
    sentences = [f"This is a story about the {topic.name}."]  # type: ignore[union-attr]
    for _ in range(rng.between(5, 14)):
        sentences.append(topic_sentence(rng, rng.pick(TOPICS) if rng.chance(0.1) else topic, state))  # type: ignore[arg-type]
    return " ".join(sentences)


def corpus(num_documents: int, seed: int = 0) -> list[str]:
    """``num_documents`` documents, the same on every machine for the same seed."""
    rng = Rng(seed)
    return [document(rng) for _ in range(num_documents)]


def sentiment_task(num_examples: int, seed: int) -> list[tuple[str, int]]:
    """``num_examples`` (review, label) pairs with balanced labels."""
    rng = Rng(seed)
    return [review(rng) for _ in range(num_examples)]
