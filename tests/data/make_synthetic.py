"""Write the small synthetic task sets in the real schemas (run once; the JSONL is committed).

    python tests/data/make_synthetic.py

MMLU-Pro: 1 test row per category (2 for math) + 5 validation rows per category (5-shot);
GPQA-Diamond: 4 rows; IFEval: 6 rows with a right and a wrong response each (answers.json),
covering instructions whose checks need nltk's punkt_tab (sentence counts)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
CATEGORIES = ["biology", "business", "chemistry", "computer science", "economics", "engineering", "health",
              "history", "law", "math", "other", "philosophy", "physics", "psychology"]
LETTERS = "ABCDEFGHIJ"


def mmlu_row(qid: int, category: str, index: int, split: str) -> dict:
    answer_index = (qid * 7 + 3) % 10
    options = [f"{category} option {k} of question {qid}" for k in range(10)]
    question = f"In this synthetic {category} {split} question number {qid}, which option names index {answer_index}?"
    letter = LETTERS[answer_index]
    cot = f"A: Let's think step by step. The option naming index {answer_index} is {letter}. The answer is ({letter})." if split == "validation" else ""
    return {"question_id": qid, "question": question, "options": options, "answer": letter, "answer_index": answer_index,
            "cot_content": cot, "category": category, "src": f"synthetic-{category}"}


def main() -> None:
    test, validation, qid = [], [], 0
    for category in CATEGORIES:
        for index in range(2 if category == "math" else 1):
            test.append(mmlu_row(qid, category, index, "test")); qid += 1
        for index in range(5):
            validation.append(mmlu_row(qid, category, index, "validation")); qid += 1
    gpqa = [
        {"Question": f"Synthetic graduate-level question {i}: which statement about system {i} is correct?",
         "Correct Answer": f"System {i} conserves quantity {i}.",
         "Incorrect Answer 1": f"System {i} doubles quantity {i}.",
         "Incorrect Answer 2": f"System {i} halves quantity {i}.",
         "Incorrect Answer 3": f"System {i} ignores quantity {i}.",
         "Record ID": f"synthetic-{i}"}
        for i in range(4)
    ]
    ifeval, answers = [], {}
    items = [
        ("Write a short note about rivers in all lowercase letters.", ["change_case:english_lowercase"], [{}],
         "rivers carry water from the hills to the sea and shape the land.", "Rivers Carry WATER To The Sea."),
        ("Describe a cat without using any commas.", ["punctuation:no_comma"], [{}],
         "A cat is a small animal that likes to sleep in the sun.", "A cat is small, soft, and quick."),
        ("Write exactly about the moon in fewer than 3 sentences.", ["length_constraints:number_sentences"], [{"relation": "less than", "num_sentences": 3}],
         "The moon orbits the Earth. It reflects sunlight.", "The moon orbits the Earth. It reflects sunlight. Dr. Smith saw it. It is bright. It waxes."),
        ("Give a title wrapped in double angular brackets, then one line about tea.", ["detectable_format:title"], [{}],
         "<<Tea Time>>\nTea is brewed from leaves.", "Tea Time\nTea is brewed from leaves."),
        ("Write at least 12 words about bread and end with the phrase 'Is there anything else I can help with?'",
         ["length_constraints:number_words", "startend:end_checker"], [{"relation": "at least", "num_words": 12}, {"end_phrase": "Is there anything else I can help with?"}],
         "Bread is baked from flour water salt and yeast in hot ovens every day. Is there anything else I can help with?", "Bread is good."),
        ("Answer in English, all capital letters, about snow.", ["change_case:english_capital", "language:response_language"], [{}, {"language": "en"}],
         "SNOW FALLS SOFTLY ON THE QUIET HILLS IN WINTER AND COVERS THE FIELDS.", "la nieve cae suavemente sobre las colinas en invierno y cubre los campos."),
    ]
    for key, (prompt, ids, kwargs, right, wrong) in enumerate(items, start=9000):
        ifeval.append({"key": key, "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs})
        answers[str(key)] = {"right": right, "wrong": wrong}
    for name, rows in (("mmlu_pro_test.jsonl", test), ("mmlu_pro_validation.jsonl", validation), ("gpqa_diamond.jsonl", gpqa), ("ifeval.jsonl", ifeval)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (HERE / "ifeval_answers.json").write_text(json.dumps(answers, indent=1) + "\n")


if __name__ == "__main__":
    main()
