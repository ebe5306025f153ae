"""Write three small institutions' FAQ answer-selection files, to follow docs/your-data.md without
data of your own: a hospital (train and test CSV), a bank and an insurer (one CSV each, with their
own column names). Each question has its right answer and three wrong ones: the institution's
answers to other kinds of request, as a real FAQ's near misses are.

    python examples/three_institutions.py DEST     # DEST/hospital/, DEST/bank.csv, DEST/insurer.csv
"""
from __future__ import annotations

import csv
import random
import sys
from pathlib import Path

# (subjects, {action: (how a customer asks, the institution's answer)}): the question never uses the
# answer's words for the action, so a ranker must learn what "can't make it" has to do with cancelling.
SUBJECTS = {
    "hospital": (["appointment", "blood test", "x-ray", "vaccination", "physiotherapy session", "check-up",
                  "scan", "consultation"],
                 {"book": ("I need a {s}, how do I get one scheduled?",
                           "Use the patient portal or call the front desk at least two days ahead."),
                  "cancel": ("I can't make it to my {s}, what should I do?",
                             "Let us know 24 hours before through the portal so the slot goes to someone else."),
                  "move": ("Can my {s} happen on another day?",
                           "Reply to your reminder text with a new date, or pick another slot online."),
                  "pay": ("Where do I settle the bill for my {s}?",
                          "Invoices are paid at reception, online under Billing, or by transfer within 30 days."),
                  "records": ("I'd like the paperwork from my {s}, where is it?",
                              "The records office sends copies within five working days of your request."),
                  "prepare": ("What should I bring along to my {s}?",
                              "Bring your insurance card and the leaflet we mailed; arrive ten minutes early.")}),
    "bank": (["credit card", "savings account", "mortgage", "current account", "overdraft", "pension plan",
              "debit card", "personal loan"],
             {"open": ("I'd like a new {s}, how do I get started?",
                       "Sign up in the app with your ID, or visit a branch with your passport."),
              "close": ("I don't want my {s} any more, how do I end it?",
                        "Send us a signed request; the remaining balance reaches you within two days."),
              "limit": ("Can I raise or lower how much my {s} allows?",
                        "Set a new limit under Settings in the app; it applies at once."),
              "fees": ("What does my {s} cost me each month?",
                       "Charges are taken from your current account on the first day of each month."),
              "lost": ("Something is wrong with my {s}, maybe fraud, who do I call?",
                       "Call the 24-hour line: we block it at once and send a replacement the same day."),
              "statement": ("Where can I see the history of my {s}?",
                            "Download statements under Documents, or ask a branch to print one.")}),
    "insurer": (["car policy", "home policy", "travel cover", "health plan", "pet insurance", "life policy",
                 "bicycle cover", "phone insurance"],
                {"start": ("I want to take out a {s}, what are the steps?",
                           "Get a quote online and sign; cover begins the next day at midnight."),
                 "cancel": ("How do I get out of my {s}?",
                            "Write to us within 14 days for a full refund, later with one month's notice."),
                 "change": ("Can I adjust what my {s} covers?",
                            "Log in and choose Change cover; the new premium is shown before you confirm."),
                 "pay": ("How are payments for my {s} made?",
                         "Monthly by direct debit, or yearly by card with a 5% discount."),
                 "claim": ("Something happened that my {s} should cover, what now?",
                           "Report it online with photos and receipts; we answer within ten days."),
                 "status": ("Where is my {s} case at the moment?",
                            "See Claims in your account, or call us with your policy number ready.")}),
}
COLUMNS = {"hospital": ("question", "answer", "label"), "bank": ("query", "response", "relevant"),
           "insurer": ("Question", "Answer", "Correct")}


def rows(institution: str, seed: int) -> list[tuple[str, str, int]]:
    """Per question (a subject and an action, asked the customer's way): the right answer, then
    three wrong ones (other actions' answers, the near misses)."""
    rnd = random.Random(seed)
    subjects, actions = SUBJECTS[institution]
    out = []
    for s in subjects:
        for action, (ask, right) in actions.items():
            q = ask.format(s=s)
            wrong = [a for other, (_, a) in actions.items() if other != action]
            out.append((q, right, 1))
            out += [(q, w, 0) for w in rnd.sample(wrong, 3)]
    return out


def write(path: Path, header, body) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(body)


def main(dest: Path) -> None:
    hospital = rows("hospital", 1)
    cut = len(hospital) * 3 // 4 // 4 * 4  # whole questions (four rows each) in train
    write(dest / "hospital" / "train.csv", COLUMNS["hospital"], hospital[:cut])
    write(dest / "hospital" / "test.csv", COLUMNS["hospital"], hospital[cut:])
    write(dest / "bank.csv", COLUMNS["bank"], rows("bank", 2))
    write(dest / "insurer.csv", COLUMNS["insurer"], rows("insurer", 3))
    print(f"written: {dest}/hospital/train.csv, test.csv, {dest}/bank.csv, {dest}/insurer.csv "
          f"({len(hospital) // 4} + 48 + 48 questions)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
