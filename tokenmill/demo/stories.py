"""Short stories in simple English from a small grammar.

The demo models must be able to write something that reads like English, and the copy task
needs passages to echo. A story follows a fixed arc (who, where, what they love, what goes
wrong, who helps, how it ends) with several interchangeable sentences per step, so a story
reads naturally while the vocabulary stays small enough for a model of a few million
parameters to learn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


def words(text: str) -> tuple[str, ...]:
    """A word list written compactly as one '|'-separated string."""
    return tuple(text.split("|"))


_GIRLS = words("Lily|Anna|Sue|Mia|Emma|Rosa|Lucy|Zoe|Nina|Molly|Ella|Ruby|Sara|Amy|Kim|Maya")
_BOYS = words("Tom|Max|Ben|Sam|Leo|Jack|Tim|Finn|Ollie|Pip|Kai|Hugo|Dan|Joe|Noah|Eli")
_ANIMALS = words(
    "cat|dog|rabbit|fox|bear|duck|mouse|owl|frog|pig|horse|lion|turtle|bird|goat|squirrel"
    "|hedgehog|sheep|cow|wolf|puppy|kitten|bunny|dragon"
)
_PEOPLE_GIRL = words("girl|princess|queen|baker|farmer|teacher|doctor|painter")
_PEOPLE_BOY = words("boy|prince|king|baker|farmer|sailor|fisherman|painter")
_ADJECTIVES = words(
    "little|small|brave|shy|happy|curious|kind|lazy|clever|old|young|tiny|big|friendly"
    "|grumpy|silly|gentle|busy|quiet|funny"
)
_PLACES = words(
    "in a small house near the woods|on a big farm|by the sea|in a busy town"
    "|at the top of a green hill|in a quiet village|deep in the forest|next to a wide river"
    "|in a garden full of flowers|in a cozy cottage|under an old oak tree|near a tall castle"
)
_GO_PLACES = words(
    "the park|the market|the beach|the forest|the lake|the hill|the farm|the school"
    "|the river|the garden|the town|the castle"
)
_ACTIVITIES = words(
    "play in the sun|sing songs|read books|run in the grass|look at the stars|build sand castles"
    "|pick flowers|bake cookies|climb trees|splash in puddles|draw pictures|dance"
    "|fly a kite|swim in the lake|watch the clouds|help in the garden"
)
_THINGS = words(
    "red ball|shiny key|blue hat|big cake|little boat|box of crayons|golden apple"
    "|warm blanket|toy train|old map|small drum|green kite|yellow scarf|magic stone"
    "|wooden spoon|silver bell"
)
_HIDING_SPOTS = words(
    "under the bed|behind the door|in the tall grass|next to the well|inside a hollow log"
    "|on top of the shelf|under a pile of leaves|near the pond|in the old barn"
    "|behind a big rock"
)
_GOOD_FEELINGS = words("happy|glad|proud|excited|calm|thankful")
_BAD_FEELINGS = words("sad|worried|scared|upset|lonely|confused")
_WEATHER = words(
    "a big storm came|it started to rain|the wind blew very hard|snow fell all night"
    "|a thick fog rolled in"
)
_MORALS = words(
    "it is good to share|friends help each other|being kind is important"
    "|you should never give up|it is okay to ask for help|small things can make a big difference"
    "|being honest is always best|every problem has an answer"
)


@dataclass(frozen=True)
class _Character:
    name: str
    kind: str
    adjective: str
    subject: str  # he / she
    object: str  # him / her
    possessive: str  # his / her


def _character(rng: random.Random, avoid: str = "") -> _Character:
    is_girl = rng.random() < 0.5
    names = [n for n in (_GIRLS if is_girl else _BOYS) if n != avoid]
    people = _PEOPLE_GIRL if is_girl else _PEOPLE_BOY
    kind = rng.choice(_ANIMALS) if rng.random() < 0.6 else rng.choice(people)
    pronouns = ("she", "her", "her") if is_girl else ("he", "him", "his")
    return _Character(rng.choice(names), kind, rng.choice(_ADJECTIVES), *pronouns)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _opening(rng: random.Random, hero: _Character, place: str) -> list[str]:
    a, k, n = hero.adjective, hero.kind, hero.name
    options = [
        f"Once upon a time, there was {_article(a)} {a} {k} named {n}. {_cap(hero.subject)} "
        f"lived {place}.",
        f"There once was {_article(a)} {a} {k} called {n}, who lived {place}.",
        f"{n} was {_article(a)} {a} {k} who lived {place}.",
        f"Long ago, {place}, there lived {_article(a)} {a} {k} named {n}.",
    ]
    return [rng.choice(options)]


def _routine(rng: random.Random, hero: _Character, friend: _Character) -> list[str]:
    s, n = hero.subject, hero.name
    a, b, c = rng.sample(_ACTIVITIES, 3)
    options = [
        f"{_cap(s)} liked to {a} every day.",
        f"Every morning, {n} would {b}.",
        f"More than anything, {n} loved to {c}.",
        f"{n} had a best friend, {_article(friend.adjective)} {friend.adjective} "
        f"{friend.kind} named {friend.name}.",
        f"{n} and {hero.possessive} friend {friend.name} liked to {a} together.",
    ]
    return rng.sample(options, rng.randrange(1, 3))


def _trouble(rng: random.Random, hero: _Character, thing: str) -> tuple[str, str]:
    """The problem sentence and the matching way it gets solved."""
    n, pos = hero.name, hero.possessive
    spot = rng.choice(_HIDING_SPOTS)
    kind = rng.randrange(4)
    if kind == 0:
        return (
            f"One day, {n} lost {pos} {thing}.",
            f"At last, they found the {thing} {spot}.",
        )
    if kind == 1:
        weather = rng.choice(_WEATHER)
        return (
            f"One day, {weather}, and {n} could not go outside.",
            "After a while, the sky was clear again, and they went out to play.",
        )
    if kind == 2:
        return (
            f"One morning, {n} found {_article(thing)} {thing} {spot}.",
            f"They asked everyone in town, and soon they found the owner of the {thing}.",
        )
    place = rng.choice(_GO_PLACES)
    return (
        f"One day, {n} wanted to go to {place}, but {hero.subject} did not know the way.",
        f"Together they walked all the way to {place}.",
    )


def _reaction(rng: random.Random, hero: _Character) -> list[str]:
    feeling = rng.choice(_BAD_FEELINGS)
    options = [
        f"{_cap(hero.subject)} felt very {feeling}.",
        f"{hero.name} was {feeling}.",
        f'"Oh no!" said {hero.name}.',
        f'"What can I do?" asked {hero.name}.',
    ]
    return [rng.choice(options)]


def _help(rng: random.Random, hero: _Character, friend: _Character) -> list[str]:
    f, n = friend.name, hero.name
    options = [
        f"{_cap(hero.subject)} asked {f} for help.",
        f'{f} the {friend.kind} came by and said, "Do not worry. I will help you."',
        f"{n} went to see {f}, and {friend.subject} said {friend.subject} would help.",
        f'"We can do it together," said {f}.',
    ]
    spots = rng.sample(_HIDING_SPOTS, 3)
    search = f"They looked {spots[0]}, {spots[1]} and {spots[2]}."
    chosen = rng.sample(options, rng.randrange(1, 3))
    return [*chosen, search] if rng.random() < 0.4 else chosen


def _ending(rng: random.Random, hero: _Character, friend: _Character) -> list[str]:
    n, f = hero.name, friend.name
    feeling = rng.choice(_GOOD_FEELINGS)
    options = [
        f"{n} was {feeling} again.",
        f"From that day on, {n} and {f} were best friends.",
        f"{n} learned that {rng.choice(_MORALS)}.",
        f'"Thank you, {f}!" said {n}, and {hero.subject} felt {feeling}.',
        f"That night, {n} went to bed with a big smile.",
    ]
    lines = rng.sample(options, rng.randrange(1, 3))
    return [*lines, "The end."] if rng.random() < 0.3 else lines


def _story(rng: random.Random) -> tuple[_Character, list[str]]:
    hero = _character(rng)
    friend = _character(rng, avoid=hero.name)
    thing = rng.choice(_THINGS)
    problem, solution = _trouble(rng, hero, thing)
    sentences = [
        *_opening(rng, hero, rng.choice(_PLACES)),
        *_routine(rng, hero, friend),
        problem,
        *_reaction(rng, hero),
        *_help(rng, hero, friend),
        solution,
        *_ending(rng, hero, friend),
    ]
    return hero, sentences


def story_sentences(rng: random.Random) -> list[str]:
    """One story, as a list of sentences (the copy task takes runs of these)."""
    return _story(rng)[1]


def story(rng: random.Random) -> str:
    return " ".join(story_sentences(rng))


def story_request(rng: random.Random) -> tuple[str, str]:
    """A chat request for a story and the story itself, whose hero matches the request."""
    hero, sentences = _story(rng)
    kind = hero.kind
    prompt = rng.choice(
        (
            f"Tell me a story about {_article(kind)} {kind}.",
            f"Write a short story about {_article(kind)} {kind}.",
            "Tell me a story.",
        )
    )
    return prompt, " ".join(sentences)
