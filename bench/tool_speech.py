"""Does a tool round trip end in speech? What a voice agent does, 20 times over varied tools: a user's question with
`tool_choice: "required"` (the model's call), the call's result as a `role: tool` message, then the follow-up reply
under `tool_choice: "auto"`, which a text-to-speech engine would read aloud. A reply counts as spoken when its content
is non-empty, holds no tool markup (`<tool_…>`, `<|…|>`) and no raw JSON, and it makes no further call. Also counted:
replies that mention one of the result's values.

    python -m bench tool-speech                      # spawns `parley serve` (the embedded model, this host's device)
    python -m bench tool-speech --url http://host:8000

Writes bench/results/tool-speech-<device>.{json,md}. Only httpx and the standard library (it runs from a client box).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.publish import RAW, RESULTS, publish
from bench.server import add_api_key_argument, auth_headers, serving, use_api_key


@dataclass(frozen=True)
class RoundTrip:
    """One round trip: a tool, a user's question that needs it, and what the tool answers."""

    tool: str
    description: str
    parameters: dict[str, Any]
    question: str
    result: dict[str, Any]

    def tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": self.tool, "description": self.description,
                                                  "parameters": self.parameters}}]

    def values(self) -> list[str]:
        """The result's values as a listener would hear them (numbers and words, not keys)."""
        return [str(v) for v in self.result.values() if isinstance(v, str | int | float) and not isinstance(v, bool)]


def _params(**props: str) -> dict[str, Any]:
    return {"type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": list(props)}


ROUND_TRIPS = [
    RoundTrip("get_weather", "Get the current weather in a city", _params(city="string"),
              "What's the weather in Paris?", {"temperature_c": 18, "sky": "cloudy"}),
    RoundTrip("get_weather", "Get the current weather in a city", _params(city="string"),
              "Is it raining in London right now?", {"temperature_c": 11, "sky": "rain"}),
    RoundTrip("get_time", "The local time in a city", _params(city="string"),
              "What time is it in Tokyo?", {"time": "21:40"}),
    RoundTrip("get_stock_price", "The latest price of a stock by its ticker", _params(ticker="string"),
              "How much is Apple stock trading at?", {"ticker": "AAPL", "price_usd": 189.5}),
    RoundTrip("convert_currency", "Convert an amount from one currency to another",
              _params(amount="number", source="string", target="string"),
              "How many euros is 100 dollars?", {"amount": 92.3, "currency": "EUR"}),
    RoundTrip("get_flight_status", "The status of a flight by its number", _params(flight="string"),
              "Is flight BA117 on time?", {"flight": "BA117", "status": "delayed", "delay_minutes": 35}),
    RoundTrip("track_package", "Where a parcel is, by its tracking number", _params(tracking_number="string"),
              "Where is my package 1Z999?", {"location": "Chicago", "eta": "Friday"}),
    RoundTrip("get_sports_score", "The score of a team's latest game", _params(team="string"),
              "How did the Lakers do last night?", {"team": "Lakers", "score": "112-104", "result": "won"}),
    RoundTrip("book_table", "Book a table at a restaurant", _params(restaurant="string", people="integer"),
              "Book a table for two at Luigi's.", {"confirmed": "yes", "time": "19:30"}),
    RoundTrip("get_calendar", "The user's events on a day", _params(day="string"),
              "What's on my calendar tomorrow?", {"event": "dentist", "time": "10:00"}),
    RoundTrip("convert_units", "Convert a quantity between units", _params(value="number", unit="string"),
              "How many kilometers is 10 miles?", {"kilometers": 16.09}),
    RoundTrip("get_population", "The population of a country", _params(country="string"),
              "How many people live in Canada?", {"population": "40 million"}),
    RoundTrip("get_traffic", "Traffic on the way to a place", _params(destination="string"),
              "How long is my drive to the airport?", {"minutes": 25, "traffic": "light"}),
    RoundTrip("get_news", "The top headline on a topic", _params(topic="string"),
              "What's the latest news about space?", {"headline": "Rocket lands on the Moon"}),
    RoundTrip("check_balance", "The balance of the user's bank account", _params(account="string"),
              "How much money is in my checking account?", {"balance_usd": 1250}),
    RoundTrip("set_alarm", "Set an alarm", _params(time="string"),
              "Wake me up at 7 am.", {"alarm_set": "07:00"}),
    RoundTrip("get_recipe", "A recipe for a dish", _params(dish="string"),
              "How long does it take to bake banana bread?", {"dish": "banana bread", "minutes": 60}),
    RoundTrip("translate", "Translate a phrase", _params(text="string", language="string"),
              "How do you say thank you in Spanish?", {"translation": "gracias"}),
    RoundTrip("get_movie_times", "Show times of a movie at the nearest cinema", _params(movie="string"),
              "When is Dune playing tonight?", {"movie": "Dune", "times": "18:00 and 21:15"}),
    RoundTrip("get_air_quality", "The air quality index of a city", _params(city="string"),
              "How is the air in Delhi today?", {"aqi": 180, "level": "unhealthy"}),
]

SYSTEM = "You are a friendly voice assistant. Answer in one short sentence."
MARKUP = re.compile(r"</?tool_|<\|")
RAW_JSON = re.compile(r"[{}\[\]]|\"\w+\"\s*:")


def judge(content: str | None, calls: list[Any] | None, trip: RoundTrip) -> dict[str, Any]:
    """What a listener would hear, and whether it counts as speech: non-empty text, no markup, no raw JSON, no call."""
    text = (content or "").strip()
    markup = bool(MARKUP.search(text))
    raw_json = bool(RAW_JSON.search(text)) or json.dumps(trip.result) in text
    called = bool(calls)
    mentions = [v for v in trip.values() if v.lower() in text.lower()]
    return {"text": text, "spoken": bool(text) and not markup and not raw_json and not called,
            "markup": markup, "raw_json": raw_json, "called_again": called, "mentions": mentions}


def round_trip(client: httpx.Client, base: str, trip: RoundTrip, max_tokens: int) -> dict[str, Any]:
    """The call, its result, the follow-up; the follow-up judged."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": trip.question}]
    first = client.post(f"{base}/v1/chat/completions", json={
        "messages": messages, "tools": trip.tools(), "tool_choice": "required", "temperature": 0,
        "max_tokens": 64}).json()
    calls = first["choices"][0]["message"].get("tool_calls") or []
    if not calls:
        return {"question": trip.question, "error": f"no call: {first}"}
    messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    for c in calls:
        messages.append({"role": "tool", "tool_call_id": c["id"], "content": json.dumps(trip.result)})
    t0 = time.perf_counter()
    follow = client.post(f"{base}/v1/chat/completions", json={
        "messages": messages, "tools": trip.tools(), "temperature": 0, "max_tokens": max_tokens}).json()
    choice = follow["choices"][0]
    message = choice["message"]
    return {"question": trip.question, "call": calls[0]["function"], "calls": len(calls), "result": trip.result,
            "finish_reason": choice["finish_reason"], "completion_tokens": follow["usage"]["completion_tokens"],
            "ms": round((time.perf_counter() - t0) * 1e3, 1),
            **judge(message.get("content"), message.get("tool_calls"), trip)}


def run(base: str, max_tokens: int) -> dict[str, Any]:
    with httpx.Client(timeout=300, headers=auth_headers()) as client:
        model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
        trips = [round_trip(client, base, t, max_tokens) for t in ROUND_TRIPS]
    done = [t for t in trips if "error" not in t]
    return {"model": model, "url": base, "max_tokens": max_tokens, "round_trips": len(trips),
            "spoken": sum(t["spoken"] for t in done), "mention_values": sum(bool(t["mentions"]) for t in done),
            "markup": sum(t["markup"] for t in done), "raw_json": sum(t["raw_json"] for t in done),
            "called_again": sum(t["called_again"] for t in done), "empty": sum(not t["text"] for t in done),
            "no_first_call": len(trips) - len(done), "target": "≥ 18 of 20 spoken", "trips": trips}


def markdown(doc: dict[str, Any], device: str) -> str:
    lines = [f"# Tool round trips end in speech ({doc['model']}, {device})", "",
             f"{doc['round_trips']} round trips (`python -m bench tool-speech`): the model's call under "
             f"`tool_choice: \"required\"`, its result as a `role: tool` message, the follow-up under \"auto\" "
             f"(greedy, max_tokens {doc['max_tokens']}).", "",
             "| figure | count |", "| --- | ---: |",
             f"| spoken replies (non-empty, no markup, no raw JSON, no further call) | {doc['spoken']} "
             f"(target ≥ 18) |",
             f"| of all, mentioning one of the result's values | {doc['mention_values']} |",
             f"| empty | {doc['empty']} |", f"| with markup | {doc['markup']} |",
             f"| with raw JSON | {doc['raw_json']} |",
             f"| calling again | {doc['called_again']} |", f"| no first call | {doc['no_first_call']} |", "",
             "| question | result | reply | spoken | mentions |", "| --- | --- | --- | :---: | --- |"]
    for t in doc["trips"]:
        if "error" in t:
            lines.append(f"| {t['question']} | | {t['error'][:80]} | no | |")
            continue
        reply = t["text"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {t['question']} | `{json.dumps(t['result'])}` | {reply} | {'yes' if t['spoken'] else 'no'} "
                     f"| {', '.join(t['mentions'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench tool-speech", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a server already running (default: spawn `parley serve`)")
    p.add_argument("--serve-flags", default="", help="flags for the spawned `parley serve`")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--device-name", default=None, help="the device in the report's name (default: the server's)")
    add_api_key_argument(p)
    args = p.parse_args(argv)
    use_api_key(args.api_key)
    if args.url:
        doc = run(args.url.rstrip("/"), args.max_tokens)
    else:
        with serving(args.serve_flags.split(), RAW / "tool-speech" / "server.log") as base:
            doc = run(base, args.max_tokens)
    device = args.device_name or _device()
    doc["device"] = device
    paths = publish(args.out, f"tool-speech-{device}", doc, markdown(doc, device))
    print(f"{doc['spoken']}/{doc['round_trips']} spoken, {doc['mention_values']} mention the result's values; "
          f"wrote {', '.join(map(str, paths))}")
    return 0 if doc["spoken"] >= 18 else 1


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
