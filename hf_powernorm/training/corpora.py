"""The embedded default corpora: generated deterministically offline, no download.

A small German/English grammar (26 nouns with gender and plural, 18 verbs, 12 adjectives, the
numbers 2-12; articles and adjectives inflected by case, gender and number; verb-second order after
a fronted adverb; verb-final subordinate clauses) gives the translation corpus and, from its English
side, the language-modelling corpus; a second grammar gives three-way sentiment sentences (opinions
with cue words and negation, financial-news statements). Each corpus is a `DatasetDict` written to
the `datasets` cache by `Dataset.from_generator`, so that tokenizing it is cached like any file.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import datasets
from datasets import ClassLabel, Dataset, DatasetDict

from .options import BadInput

SENTIMENT_LABELS = ("negative", "neutral", "positive")


# (gender, German singular, German plural, English singular, English plural)
_NOUNS = (
    ("m", "Hund", "Hunde", "dog", "dogs"), ("m", "Mann", "Männer", "man", "men"),
    ("m", "Lehrer", "Lehrer", "teacher", "teachers"), ("m", "Vogel", "Vögel", "bird", "birds"),
    ("m", "Apfel", "Äpfel", "apple", "apples"), ("m", "Ball", "Bälle", "ball", "balls"),
    ("m", "Tisch", "Tische", "table", "tables"), ("m", "Brief", "Briefe", "letter", "letters"),
    ("m", "Arzt", "Ärzte", "doctor", "doctors"), ("m", "König", "Könige", "king", "kings"),
    ("f", "Katze", "Katzen", "cat", "cats"), ("f", "Frau", "Frauen", "woman", "women"),
    ("f", "Blume", "Blumen", "flower", "flowers"), ("f", "Stadt", "Städte", "city", "cities"),
    ("f", "Lampe", "Lampen", "lamp", "lamps"), ("f", "Maus", "Mäuse", "mouse", "mice"),
    ("f", "Tür", "Türen", "door", "doors"), ("f", "Schule", "Schulen", "school", "schools"),
    ("n", "Kind", "Kinder", "child", "children"), ("n", "Haus", "Häuser", "house", "houses"),
    ("n", "Buch", "Bücher", "book", "books"), ("n", "Pferd", "Pferde", "horse", "horses"),
    ("n", "Auto", "Autos", "car", "cars"), ("n", "Mädchen", "Mädchen", "girl", "girls"),
    ("n", "Fenster", "Fenster", "window", "windows"), ("n", "Schiff", "Schiffe", "ship", "ships"),
)
# (German 3rd singular, German 3rd plural, English 3rd singular, English plural)
_TRANSITIVE = (
    ("sieht", "sehen", "sees", "see"), ("kauft", "kaufen", "buys", "buy"),
    ("findet", "finden", "finds", "find"), ("liebt", "lieben", "loves", "love"),
    ("hört", "hören", "hears", "hear"), ("malt", "malen", "paints", "paint"),
    ("sucht", "suchen", "looks for", "look for"), ("trägt", "tragen", "carries", "carry"),
    ("baut", "bauen", "builds", "build"), ("zeigt", "zeigen", "shows", "show"),
    ("öffnet", "öffnen", "opens", "open"), ("vergisst", "vergessen", "forgets", "forget"),
)
_INTRANSITIVE = (
    ("schläft", "schlafen", "sleeps", "sleep"), ("lacht", "lachen", "laughs", "laugh"),
    ("läuft", "laufen", "runs", "run"), ("singt", "singen", "sings", "sing"),
    ("wartet", "warten", "waits", "wait"), ("schwimmt", "schwimmen", "swims", "swim"),
)
# (German stem, English): the German ending depends on article, case, gender and number.
_ADJECTIVES = (
    ("groß", "big"), ("klein", "small"), ("alt", "old"), ("jung", "young"), ("rot", "red"),
    ("blau", "blue"), ("schnell", "fast"), ("langsam", "slow"), ("schön", "beautiful"),
    ("neu", "new"), ("müd", "tired"), ("klug", "clever"),
)
_NUMBERS = (
    ("zwei", "two"), ("drei", "three"), ("vier", "four"), ("fünf", "five"), ("sechs", "six"),
    ("sieben", "seven"), ("acht", "eight"), ("neun", "nine"), ("zehn", "ten"), ("elf", "eleven"),
    ("zwölf", "twelve"),
)
_ADVERBS = (("heute", "today"), ("jetzt", "now"), ("manchmal", "sometimes"),
            ("leider", "unfortunately"), ("hier", "here"))
_SUBORDINATORS = (("weil", "because"), ("während", "while"), ("obwohl", "although"), ("wenn", "when"))
_REPORTING = (("glaubt", "glauben", "believes", "believe"), ("sagt", "sagen", "says", "say"),
              ("weiß", "wissen", "knows", "know"))
_DEF_ARTICLE = {("nom", "m"): "der", ("nom", "f"): "die", ("nom", "n"): "das",
                ("acc", "m"): "den", ("acc", "f"): "die", ("acc", "n"): "das"}
_INDEF_ARTICLE = {("nom", "m"): "ein", ("nom", "f"): "eine", ("nom", "n"): "ein",
                  ("acc", "m"): "einen", ("acc", "f"): "eine", ("acc", "n"): "ein"}
_WEAK_ENDING = {("nom", "m"): "e", ("nom", "f"): "e", ("nom", "n"): "e",
                ("acc", "m"): "en", ("acc", "f"): "e", ("acc", "n"): "e"}
_MIXED_ENDING = {("nom", "m"): "er", ("nom", "f"): "e", ("nom", "n"): "es",
                 ("acc", "m"): "en", ("acc", "f"): "e", ("acc", "n"): "es"}


@dataclass
class _Phrase:
    de: list[str]
    en: list[str]
    plural: bool = False


def _noun_phrase(rng: random.Random, case: str) -> _Phrase:
    """A German noun phrase inflected for `case` and its English translation."""
    gender, de_sg, de_pl, en_sg, en_pl = rng.choice(_NOUNS)
    adjective = rng.choice(_ADJECTIVES) if rng.random() < 0.5 else None
    kind = rng.choice(("definite", "definite", "indefinite", "plural", "number"))
    key = (case, gender)
    if kind == "definite":
        de, en, ending, noun = [_DEF_ARTICLE[key]], ["the"], _WEAK_ENDING[key], (de_sg, en_sg)
    elif kind == "indefinite":
        first = adjective[1] if adjective else en_sg
        article = "an" if first[0] in "aeiou" else "a"
        de, en, ending, noun = [_INDEF_ARTICLE[key]], [article], _MIXED_ENDING[key], (de_sg, en_sg)
    elif kind == "plural":
        de, en, ending, noun = ["die"], ["the"], "en", (de_pl, en_pl)
    else:
        number = rng.choice(_NUMBERS)
        de, en, ending, noun = [number[0]], [number[1]], "e", (de_pl, en_pl)
    if adjective:
        de.append(adjective[0] + ending)
        en.append(adjective[1])
    return _Phrase(de + [noun[0]], en + [noun[1]], plural=kind in ("plural", "number"))


def _clause(rng: random.Random) -> tuple[_Phrase, list[str], list[str], _Phrase | None]:
    """Subject, German verb, English verb and optional object of one clause."""
    subject = _noun_phrase(rng, "nom")
    number = 1 if subject.plural else 0
    if rng.random() < 0.7:
        verb = rng.choice(_TRANSITIVE)
        return subject, [verb[number]], verb[2 + number].split(), _noun_phrase(rng, "acc")
    verb = rng.choice(_INTRANSITIVE)
    return subject, [verb[number]], [verb[2 + number]], None


def _main_order(rng: random.Random) -> tuple[list[str], list[str]]:
    """German verb-second main clause, optionally fronted by an adverb (subject-verb inversion)."""
    subject, de_verb, en_verb, obj = _clause(rng)
    de_obj, en_obj = (obj.de, obj.en) if obj else ([], [])
    if rng.random() < 0.3:
        de_adv, en_adv = rng.choice(_ADVERBS)
        return [de_adv, *de_verb, *subject.de, *de_obj], [en_adv, *subject.en, *en_verb, *en_obj]
    return [*subject.de, *de_verb, *de_obj], [*subject.en, *en_verb, *en_obj]


def _subordinate(rng: random.Random) -> tuple[list[str], list[str]]:
    """A German subordinate clause: the finite verb goes to the end."""
    subject, de_verb, en_verb, obj = _clause(rng)
    de_obj, en_obj = (obj.de, obj.en) if obj else ([], [])
    return [*subject.de, *de_obj, *de_verb], [*subject.en, *en_verb, *en_obj]


def _sentence_pair(rng: random.Random) -> tuple[str, str]:
    """One German sentence and its English translation, both tokenized with spaces."""
    shape = rng.random()
    de, en = _main_order(rng)
    if shape < 0.3:
        sub_de, sub_en = _subordinate(rng)
        conj_de, conj_en = rng.choice(_SUBORDINATORS)
        de, en = [*de, ",", conj_de, *sub_de], [*en, ",", conj_en, *sub_en]
    elif shape < 0.45:
        speaker = _noun_phrase(rng, "nom")
        verb = rng.choice(_REPORTING)
        number = 1 if speaker.plural else 0
        sub_de, sub_en = _subordinate(rng)
        de = [*speaker.de, verb[number], ",", "dass", *sub_de]
        en = [*speaker.en, verb[2 + number], "that", *sub_en]
    elif shape < 0.55:
        other_de, other_en = _main_order(rng)
        de, en = [*de, "und", *other_de], [*en, "and", *other_en]
    return _capitalize(" ".join(de + ["."])), _capitalize(" ".join(en + ["."]))


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


def _unique_samples(make: Callable[[random.Random], Any], sizes: dict[str, int], seed: int,
                    key: Callable[[Any], str]) -> dict[str, list[Any]]:
    """Draw distinct samples for every split: no sentence appears in two splits."""
    rng, seen, out = random.Random(seed), set(), {}
    for split, size in sizes.items():
        out[split] = []
        while len(out[split]) < size:
            sample = make(rng)
            if key(sample) not in seen:
                seen.add(key(sample))
                out[split].append(sample)
    return out


def _generated_rows(kind: str, sizes: dict[str, int], seed: int, split: str) -> Iterator[dict[str, Any]]:
    """The rows of one split of an embedded corpus (every split is drawn, so no row is in two)."""
    if kind == "translation":
        pairs = _unique_samples(_sentence_pair, sizes, seed, key=lambda p: p[0])[split]
        yield from ({"translation": {"de": de, "en": en}} for de, en in pairs)
    elif kind == "lm":
        lines = _unique_samples(lambda rng: _sentence_pair(rng)[1], sizes, seed, key=lambda s: s)[split]
        yield from ({"text": line} for line in lines)
    else:
        rows = _unique_samples(_sentiment_example, sizes, seed, key=lambda s: s[0])[split]
        yield from ({"text": text, "label": SENTIMENT_LABELS.index(label)} for text, label in rows)


def _generated_corpus(kind: str, sizes: dict[str, int], seed: int, features: datasets.Features) -> DatasetDict:
    for split, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise BadInput(f"split {split!r} of the embedded corpus needs a positive size; got {size!r}")
    return DatasetDict({
        split: Dataset.from_generator(_generated_rows, features=features,
                                      gen_kwargs={"kind": kind, "sizes": sizes, "seed": seed, "split": split})
        for split in sizes
    })


def synthetic_translation_corpus(source_lang: str = "de", target_lang: str = "en",
                                 sizes: dict[str, int] | None = None, seed: int = 0) -> DatasetDict:
    """The embedded German<->English translation corpus, generated deterministically from `seed`
    (default sizes 4,000 / 300 / 300 pairs).

    Every pair follows a small grammar: article/adjective inflection by case, gender and number,
    verb-second order after a fronted adverb, and verb-final order in subordinate clauses.
    """
    pair = {source_lang, target_lang}
    if pair != {"de", "en"}:
        raise BadInput(f"the embedded translation corpus is German/English (de, en); got the pair "
                       f"{source_lang}-{target_lang}. Pass --train_file etc. for other languages.")
    sizes = sizes or {"train": 4000, "validation": 300, "test": 300}
    features = datasets.Features({"translation": {"de": datasets.Value("string"), "en": datasets.Value("string")}})
    return _generated_corpus("translation", sizes, seed, features)


def synthetic_lm_corpus(sizes: dict[str, int] | None = None, seed: int = 1) -> DatasetDict:
    """The embedded language-modelling corpus: English sentences of the translation grammar
    (default sizes 6,000 / 400 / 400 lines)."""
    sizes = sizes or {"train": 6000, "validation": 400, "test": 400}
    return _generated_corpus("lm", sizes, seed, datasets.Features({"text": datasets.Value("string")}))


_SENTIMENT_SUBJECTS = ("the film", "the service", "the hotel", "the food", "the new phone",
                       "the staff", "the outlook", "the quarterly report", "the product launch",
                       "the customer support", "the delivery", "the merger")
_POSITIVE_CUES = ("good", "great", "excellent", "impressive", "strong", "pleasant", "reliable")
_NEGATIVE_CUES = ("bad", "poor", "terrible", "weak", "disappointing", "awful", "unreliable")
_NEUTRAL_PREDICATES = ("scheduled for monday", "described in the annual report", "based in helsinki",
                       "available in three colours", "handled by a subsidiary", "due next year",
                       "listed on the website", "similar to last year")
_INTENSIFIERS = ("", "", "very", "really", "quite", "extremely")
_METRICS = (("net sales", "were"), ("operating profit", "was"), ("revenue", "was"),
            ("the share price", "was"), ("orders", "were"), ("earnings", "were"))
_UP_VERBS = ("rose", "increased", "grew", "improved")
_DOWN_VERBS = ("fell", "decreased", "dropped", "declined")
_CONTEXTS = ("", "", "according to the company ,", "in the third quarter ,", "last year ,")


def _opinion(rng: random.Random) -> tuple[str, str]:
    """`<subject> was [not] [very] <cue>`: negation flips the polarity of the cue word."""
    label = rng.choice(SENTIMENT_LABELS)
    subject, verb = rng.choice(_SENTIMENT_SUBJECTS), rng.choice(("was", "is"))
    if label == "neutral":
        return f"{subject} {verb} {rng.choice(_NEUTRAL_PREDICATES)}", label
    negate = rng.random() < 0.3
    polar = label if not negate else ("positive" if label == "negative" else "negative")
    cue = rng.choice(_POSITIVE_CUES if polar == "positive" else _NEGATIVE_CUES)
    words = [subject, verb, "not" if negate else "", rng.choice(_INTENSIFIERS), cue]
    return " ".join(w for w in words if w), label


def _financial(rng: random.Random) -> tuple[str, str]:
    """`<metric> rose|fell by N %` (or `did not rise`), or a neutral statement of the figure."""
    label, (metric, be) = rng.choice(SENTIMENT_LABELS), rng.choice(_METRICS)
    context, amount = rng.choice(_CONTEXTS), f"{rng.randint(1, 40)}.{rng.randint(0, 9)}"
    if label == "neutral":
        body = rng.choice((f"{metric} {be} eur {amount} mn", f"{metric} remained unchanged",
                           f"the company will report {metric} in march"))
    elif rng.random() < 0.25:
        verb = "rise" if label == "negative" else "fall"
        body = f"{metric} did not {verb}"
    else:
        body = f"{metric} {rng.choice(_UP_VERBS if label == 'positive' else _DOWN_VERBS)} by {amount} %"
    return f"{context} {body}".strip(), label


def _sentiment_example(rng: random.Random) -> tuple[str, str]:
    text, label = (_opinion if rng.random() < 0.5 else _financial)(rng)
    return _capitalize(text) + " .", label


def synthetic_classification_corpus(sizes: dict[str, int] | None = None, seed: int = 2) -> DatasetDict:
    """The embedded three-way sentiment corpus (negative/neutral/positive, with negation; default
    sizes 3,000 / 300 / 300 sentences)."""
    sizes = sizes or {"train": 3000, "validation": 300, "test": 300}
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": ClassLabel(names=list(SENTIMENT_LABELS))})
    return _generated_corpus("classification", sizes, seed, features)
