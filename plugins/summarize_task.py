"""A miniature summarisation task for the default recipe, and its reward.

The task
--------
Each document is two or three short sentences (at most ``MAX_DOCUMENT_BYTES`` bytes, so a
byte-level policy stays cheap to run). Exactly one sentence reports an event: *who* did *what*
to *which thing*, *where* ("The baker sold bread in Paris."). The other sentences are filler a
summary should drop; some of them name a second person or a second city, so the policy cannot just
copy "the first occupation" or "the last city" it sees. The event sentence takes one of several
phrasings (active, passive, fronted place, "It was in ... that ...", reported speech, ...) and sits
at a random position, so the summary is a small rewriting job, not a fixed slice of the input.

The reference summary is always the canonical active sentence: ``"The baker sold bread in Paris."``
``filler_sentences(record)`` gives a document's other sentences; the default recipe's warm start
learns from careless summaries that copy one of them after the fact (see ``summarize.WarmStartSummarizer``).

Words are drawn from lists of 30 occupations x 20 verbs x 30 objects x 30 cities = 540,000
distinct facts, far more than any training run sees, so a policy has to read the document.

Prompts are ``document + PROMPT_SEPARATOR`` with ``PROMPT_SEPARATOR = "\\nSummary: "``; the model's
response is the summary text (then EOS). Tokenise prompts with ``add_special_tokens=False``:
``ByT5Tokenizer`` otherwise appends EOS to the prompt.

Train / eval separation
-----------------------
Every fact (who, verb, object, city) is assigned to a split by a stable hash (CRC-32), one in
``EVAL_FRACTION_DENOMINATOR`` facts to "eval". ``make_corpus(n, seed, split=...)`` only draws facts
of its split, so the train and eval sets share no fact at all, whatever the seeds.

The reward
----------
``summary_reward`` is ROUGE-1 F1 (unigram overlap between the response and the reference, on
lowercase word tokens with punctuation stripped), optionally mixed with ROUGE-L F1:

    reward = (1 - rouge_l_weight) * ROUGE-1 F1 + rouge_l_weight * ROUGE-L F1      (in [0, 1])

Why ROUGE-1 F1 by default: it is the standard summary-quality measure a reader knows, and it is
*dense* — every correct content word earns ~1/6 — which is what PPO needs from a weak warm start
(measured: a unigram-F1 reward learned within minutes where a sparser one did not). No separate
brevity term: F1's precision half already penalises rambling and run-on responses that never emit
EOS, and its recall half penalises dropping facts; a second length term would double-count. Note
the template words ("the", "in") make up a third of a reference, so a summary-shaped response with
every fact wrong still scores about 0.3; a correct one scores 1.0.
"""

from __future__ import annotations

import random
import re
import zlib
from collections import Counter
from collections.abc import Sequence

PROMPT_SEPARATOR = "\nSummary: "
MAX_DOCUMENT_BYTES = 110
EVAL_FRACTION_DENOMINATOR = 8  # one fact in 8 belongs to the eval split

WHO = (
    "baker", "nurse", "pilot", "farmer", "tailor", "doctor", "miner", "sailor", "teacher",
    "judge", "guard", "chef", "clerk", "driver", "poet", "singer", "actor", "banker", "coach",
    "plumber", "painter", "writer", "dancer", "lawyer", "waiter", "hunter", "barber", "butcher",
    "potter", "mayor",
)

# (simple past, past participle)
VERBS = (
    ("sold", "sold"), ("bought", "bought"), ("painted", "painted"), ("cooked", "cooked"),
    ("found", "found"), ("carried", "carried"), ("cleaned", "cleaned"), ("fixed", "fixed"),
    ("delivered", "delivered"), ("packed", "packed"), ("washed", "washed"), ("stole", "stolen"),
    ("lost", "lost"), ("made", "made"), ("moved", "moved"), ("hid", "hidden"),
    ("ate", "eaten"), ("sent", "sent"), ("broke", "broken"), ("took", "taken"),
)

# (object, "was"/"were" for the passive phrasing)
WHAT = (
    ("bread", "was"), ("fish", "was"), ("rice", "was"), ("soup", "was"), ("cheese", "was"),
    ("coffee", "was"), ("wood", "was"), ("paper", "was"), ("honey", "was"), ("salt", "was"),
    ("apples", "were"), ("books", "were"), ("chairs", "were"), ("boxes", "were"),
    ("lamps", "were"), ("shoes", "were"), ("maps", "were"), ("coins", "were"), ("tools", "were"),
    ("cakes", "were"), ("hats", "were"), ("toys", "were"), ("plates", "were"), ("kites", "were"),
    ("rugs", "were"), ("eggs", "were"), ("bikes", "were"), ("pens", "were"), ("keys", "were"),
    ("cups", "were"),
)

WHERE = (
    "Paris", "Rome", "Oslo", "Lima", "Cairo", "Delhi", "Tokyo", "Seoul", "Dubai", "Quito",
    "Kyiv", "Accra", "Hanoi", "Perth", "Miami", "Boston", "Dallas", "Madrid", "Lisbon", "Vienna",
    "Prague", "Berlin", "Dublin", "Athens", "Sofia", "Riga", "Bern", "Nice", "Lyon", "Porto",
)

# Phrasings of the event sentence. Fields: who, did (past), done (participle), what, be, where.
_KEY_TEMPLATES = (
    "The {who} {did} {what} in {where}.",
    "In {where}, the {who} {did} {what}.",
    "{What} {be} {done} by the {who} in {where}.",
    "In {where}, {what} {be} {done} by the {who}.",
    "Yesterday the {who} {did} {what} in {where}.",
    "It was in {where} that the {who} {did} {what}.",
    "Locals say the {who} {did} {what} in {where}.",
    "The {who} {did} {what} while in {where}.",
)

# Filler sentences: no event; some name a distractor person ({who2}) or city ({where2}).
_FILLER_TEMPLATES = (
    "It was a cold day.",
    "Nobody saw it coming.",
    "The streets were quiet.",
    "A crowd soon gathered.",
    "Prices rose all week.",
    "Later, everyone went home.",
    "It made the news.",
    "Few people were surprised.",
    "The sky was grey.",
    "It rained in {where2}.",
    "The weather in {where2} was mild.",
    "The {who2} was away.",
    "The {who2} said nothing.",
    "Some said the {who2} knew.",
    "The {who2} had left {where2}.",
)

_WORD_RE = re.compile(r"[a-z0-9]+")


def fact_split(who: str, did: str, what: str, where: str) -> str:
    """"eval" for one fact in EVAL_FRACTION_DENOMINATOR (stable across runs), else "train"."""
    key = f"{who}|{did}|{what}|{where}".encode()
    return "eval" if zlib.crc32(key) % EVAL_FRACTION_DENOMINATOR == 0 else "train"


def format_prompt(document: str) -> str:
    """The text the policy sees: the document, then the separator after which it summarises."""
    return document + PROMPT_SEPARATOR


def _make_record(rng: random.Random, split: str) -> dict:
    while True:
        who = rng.choice(WHO)
        did, done = rng.choice(VERBS)
        what, be = rng.choice(WHAT)
        where = rng.choice(WHERE)
        if fact_split(who, did, what, where) == split:
            break
    key = rng.choice(_KEY_TEMPLATES).format(
        who=who, did=did, done=done, what=what, What=what.capitalize(), be=be, where=where
    )
    reference = f"The {who} {did} {what} in {where}."
    while True:
        n_filler = rng.choice((1, 2))
        fillers = []
        for template in rng.sample(_FILLER_TEMPLATES, n_filler):
            fillers.append(template.format(
                who2=rng.choice([w for w in WHO if w != who]),
                where2=rng.choice([c for c in WHERE if c != where]),
            ))
        sentences = list(fillers)
        sentences.insert(rng.randrange(n_filler + 1), key)
        document = " ".join(sentences)
        if len(document.encode()) <= MAX_DOCUMENT_BYTES:
            break
    return {"prompt": format_prompt(document), "document": document, "reference": reference}


def make_corpus(n: int, seed: int, split: str = "train") -> list[dict]:
    """``n`` records ``{"prompt", "document", "reference"}``, deterministic in (n, seed, split).

    ``split`` is "train" or "eval"; the two splits never share a fact (see module docstring), so
    e.g. ``make_corpus(5000, 0)`` and ``make_corpus(200, 1, split="eval")`` do not overlap.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = random.Random(f"rlkit-summarize/{split}/{seed}")
    return [_make_record(rng, split) for _ in range(n)]


def words(text: str) -> list[str]:
    """Lowercase word tokens, punctuation stripped (the tokenisation every ROUGE here uses)."""
    return _WORD_RE.findall(text.lower())


def _f1(overlap: float, n_candidate: int, n_reference: int) -> float:
    if overlap <= 0 or n_candidate == 0 or n_reference == 0:
        return 0.0
    precision = overlap / n_candidate
    recall = overlap / n_reference
    return 2 * precision * recall / (precision + recall)


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def rouge_n_f1(candidate: str, reference: str, n: int = 1) -> float:
    """ROUGE-N F1: clipped n-gram overlap count; precision over the candidate's n-grams, recall
    over the reference's. 0.0 when either side has no n-gram."""
    if n < 1:
        raise ValueError("n must be >= 1")
    cand = _ngrams(words(candidate), n)
    ref = _ngrams(words(reference), n)
    overlap = sum((cand & ref).values())
    return _f1(overlap, sum(cand.values()), sum(ref.values()))


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    if not a or not b:
        return 0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l_f1(candidate: str, reference: str) -> float:
    """ROUGE-L F1 (sentence level): longest common subsequence of word tokens; precision over the
    candidate's length, recall over the reference's."""
    cand, ref = words(candidate), words(reference)
    return _f1(_lcs_length(cand, ref), len(cand), len(ref))


def summary_reward(response: str, reference: str, *, rouge_l_weight: float = 0.0) -> float:
    """Summary quality in [0, 1]: ``(1-w)·ROUGE-1 F1 + w·ROUGE-L F1`` with ``w = rouge_l_weight``.

    The default (w = 0) is plain ROUGE-1 F1; see the module docstring for why.
    """
    if not 0.0 <= rouge_l_weight <= 1.0:
        raise ValueError("rouge_l_weight must be in [0, 1]")
    score = (1.0 - rouge_l_weight) * rouge_n_f1(response, reference, 1)
    if rouge_l_weight:
        score += rouge_l_weight * rouge_l_f1(response, reference)
    return score


def filler_sentences(record: dict) -> list[str]:
    """The document's sentences that do not report the event (they never name its *who*)."""
    who = words(record["reference"])[1]
    return [s + "." for s in record["document"].rstrip(".").split(". ") if who not in words(s)]


def fact_copied(response: str, reference: str) -> float:
    """1.0 when every word of the reference's fact (who, did, what, where) appears in the response,
    else 0.0: stricter than ROUGE, which gives partial credit for a summary with a wrong place."""
    fact = set(words(reference)) - {"the", "in"}
    return float(fact <= set(words(response)))


def exact_summary(response: str, reference: str) -> float:
    """1.0 when the response's words are the reference's, in order (case and punctuation aside),
    else 0.0: the whole fact and nothing more, stricter than ``fact_copied``."""
    return float(words(response) == words(reference))
