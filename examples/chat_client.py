"""Talk to `qfd serve` with the official OpenAI client (streaming chat, then the server's
speculative-decoding metrics).

    qfd serve --target runs/demo/2-qad --drafter runs/demo/8-draft-swa --port 8000 &
    python examples/chat_client.py --port 8000 "How many legs do three spiders have?"
"""

from __future__ import annotations

import argparse
import urllib.request

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default="none", help="the key given to `qfd serve --api-key`, if any")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    base = f"http://127.0.0.1:{args.port}"
    client = OpenAI(base_url=f"{base}/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": args.prompt}],
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    metrics = urllib.request.urlopen(f"{base}/metrics").read().decode()
    print("\n".join(line for line in metrics.splitlines() if line.startswith("qfd_") and "bucket" not in line))


if __name__ == "__main__":
    main()
