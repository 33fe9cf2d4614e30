"""codes: exact recall of order numbers and refund amounts from customer-service chats.

The document is a transcript of several chats, each with one 7-digit order number and one
refund amount among small talk; questions alternate between the order number of one customer
and the refund of another. Exact digits are what FP4 keys blur first. The answer prefix echoes
the transcript's wording ("<name>, order number ..."): SmolLM2 finds about 7 answers in 10
this way, against 4 in 10 with a rephrased prefix.
"""

from __future__ import annotations

import itertools

from kvtune.autotune.evaluation.suite import TaskSize
from kvtune.autotune.evaluation.tasks.common import (
    QA,
    Conversation,
    GenContext,
    Question,
    TaskDef,
    qa_rows,
    random_digits,
)

MIN_CHATS = 4
INTRO = "Below are transcripts of customer service chats."
FIRST_NAMES = (
    "Maria",
    "James",
    "Aisha",
    "Kenji",
    "Olga",
    "Pedro",
    "Fatima",
    "Lucas",
    "Ingrid",
    "Omar",
    "Chloe",
    "Dmitri",
    "Priya",
    "Samuel",
    "Yuki",
    "Elena",
    "Tomas",
    "Grace",
    "Rafael",
    "Amara",
)
LAST_NAMES = (
    "Lopez",
    "Carter",
    "Okafor",
    "Tanaka",
    "Petrova",
    "Silva",
    "Haddad",
    "Moreau",
    "Larsen",
    "Farouk",
    "Dubois",
    "Ivanov",
    "Sharma",
    "Bennett",
    "Sato",
    "Rossi",
    "Novak",
    "Mendes",
    "Keller",
    "Osei",
)
PRODUCTS = (
    "blender",
    "desk lamp",
    "rain jacket",
    "coffee grinder",
    "bike helmet",
    "phone case",
    "yoga mat",
    "kettle",
    "backpack",
    "printer",
    "air fryer",
    "office chair",
    "toaster",
    "hair dryer",
    "garden hose",
    "travel mug",
)
PROBLEMS = (
    "arrived with a cracked lid",
    "was the wrong colour",
    "stopped working after two days",
    "never arrived",
    "was missing a part",
    "was charged twice",
    "came with a broken handle",
    "smells of burnt plastic",
)
AGENT_LINES = (
    "I am sorry to hear that.",
    "Let me look into this for you.",
    "Thank you for your patience.",
    "I have noted this on your account.",
    "That should not have happened.",
    "Could you describe the problem in a bit more detail?",
    "I will pass this on to our quality team.",
    "You will receive an email confirmation shortly.",
    "Our courier partner has been informed.",
    "There is no need to send the item back.",
    "I understand how frustrating this must be.",
    "I have added a note for our warehouse.",
    "Could you confirm the email address on the account?",
    "I can see the delivery scan from our depot.",
    "Our returns team usually replies within a day.",
    "I will stay on the chat while the system updates.",
)
CUSTOMER_LINES = (
    "I have been waiting for a week now.",
    "I already tried restarting it.",
    "The box looked fine from the outside.",
    "I would prefer a refund to a replacement.",
    "Could you please check what happened?",
    "It was meant to be a birthday present for my sister.",
    "I ordered it because the reviews were good.",
    "The delivery driver left it at the wrong door.",
    "My neighbour had the same problem last month.",
    "I do not have the original packaging any more.",
    "I checked the instructions twice.",
    "Is there a shop near me where I can return it?",
    "I would rather not wait another week.",
    "Thanks, that is really helpful.",
    "Sorry, my connection is a bit slow today.",
    "Yes, the email address is still the same.",
)


def _chat(number: int, opening: str, fillers: list[str], closing: str) -> str:
    return "\n".join([f"--- Chat {number} ---", opening, *fillers, closing])


def draw(context: GenContext, doc: int, size: TaskSize) -> Conversation:
    """Questions alternate between an order number and another customer's refund."""
    return draw_asking(context, size, refunds=True)


def draw_orders(context: GenContext, doc: int, size: TaskSize) -> Conversation:
    """Order numbers only: digits that end at a full stop, so a generated answer is cut
    where the number ends (a refund's decimal point would cut it)."""
    return draw_asking(context, size, refunds=False)


def draw_asking(context: GenContext, size: TaskSize, refunds: bool) -> Conversation:
    """One transcript; refunds: every second question asks a refund, not an order number."""
    rng = context.rng
    count = max(MIN_CHATS, size.questions)
    names = [
        f"{first} {last}"
        for first, last in zip(
            rng.sample(FIRST_NAMES, count), rng.sample(LAST_NAMES, count), strict=True
        )
    ]
    orders = [random_digits(rng, 7) for _ in names]
    amounts = [f"{rng.randrange(10, 500)}.{rng.randrange(100):02d}" for _ in names]
    openings, closings = [], []
    for name, order in zip(names, orders, strict=True):
        product, problem = rng.choice(PRODUCTS), rng.choice(PROBLEMS)
        openings.append(f"Customer: Hi, I am {name}, order number {order}. My {product} {problem}.")
    for name, amount in zip(names, amounts, strict=True):
        closings.append(f"Agent: Done, {name} was refunded ${amount}. {rng.choice(AGENT_LINES)}")
    # Shuffled, so that the asked chats sit anywhere in the transcript.
    order = rng.sample(range(count), count)
    depths = [order.index(i) / count for i in range(count)]  # where each chat opens
    questions = tuple(
        Question(
            f"How much was refunded to {name}? Answer with the amount only.",
            f"{name} was refunded $",
            amount,
            depth,
        )
        if refunds and turn % 2
        else Question(
            f"What is the order number of {name}? Answer with the 7-digit number only.",
            f"{name}, order number ",
            number,
            depth,
        )
        for turn, (name, number, amount, depth) in enumerate(
            list(zip(names, orders, amounts, depths, strict=True))[: size.questions]
        )
    )
    fillers: list[list[str]] = [[] for _ in names]

    def transcript() -> str:
        chats = [_chat(n + 1, openings[i], fillers[i], closings[i]) for n, i in enumerate(order)]
        return "\n\n".join([INTRO, *chats])

    budget = context.document_budget(questions[0])
    # Small talk, one exchange a chat in turn, while the transcript fits the budget.
    for turn in itertools.count():
        exchange = [f"Agent: {rng.choice(AGENT_LINES)}", f"Customer: {rng.choice(CUSTOMER_LINES)}"]
        fillers[turn % count].extend(exchange)
        if context.count(transcript()) > budget:
            del fillers[turn % count][-2:]
            break
    return Conversation(transcript(), questions)


TASK = TaskDef(
    name="codes",
    kind=QA,
    chance=1 / 9_000_000,
    max_questions=min(len(FIRST_NAMES), len(LAST_NAMES)),
    build=lambda context, size: qa_rows(context, size, draw),
)
