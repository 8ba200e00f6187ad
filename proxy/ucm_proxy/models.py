"""The models the backends serve, as their ``/v1/models`` shows them: base models and LoRA adapters.

vLLM serves each adapter under a name of its own: a request's ``model`` is a base model's served
name or an adapter's, and an adapter's card names its base model (``parent``) and where its weights
come from (``root``). The proxy lists the union over its backends with those two fields as vLLM
shows them, refuses a model no backend serves, and tells routing which requests run an adapter:
their KV is the adapter's, never the base model's nor another adapter's.
"""

from __future__ import annotations

from typing import Any

Card = dict[str, str]  # what the proxy shows of a model besides its id: its parent and root, when given
_SHOWN = ("parent", "root")


def read_cards(answer: Any) -> dict[str, Card]:
    """The models of one backend's ``/v1/models`` answer, by id (``ValueError`` if it is no list)."""
    data = answer.get("data", []) if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models answered no list of models")
    return {
        card["id"]: {k: card[k] for k in _SHOWN if isinstance(card.get(k), str)}
        for card in data
        if isinstance(card, dict) and isinstance(card.get("id"), str) and card["id"]
    }


class Models:
    """What the last health round learned: every model some backend serves, with its card."""

    def __init__(self) -> None:
        self.cards: dict[str, Card] = {}

    def __bool__(self) -> bool:
        return bool(self.cards)

    def __contains__(self, name: object) -> bool:
        return name in self.cards

    def update(self, answers: list[dict[str, Card]]) -> None:
        """The union of one round's answers; a round in which no backend answered changes nothing."""
        merged: dict[str, Card] = {}
        for cards in answers:
            for name, card in cards.items():
                # Backends that show one model differently (an adapter mid-rollout) answer in no set
                # order: the least card, so that the listing does not flap between rounds.
                if name not in merged or sorted(card.items()) < sorted(merged[name].items()):
                    merged[name] = card
        if merged:
            self.cards = merged

    def adapter(self, name: str) -> str | None:
        """``name`` if it is a LoRA adapter's (its card has a parent); None for a base model, or a
        model not known (yet)."""
        card = self.cards.get(name)
        return name if card is not None and "parent" in card else None

    def base(self) -> str:
        """A base model's name (the least), for requests of the proxy's own; an adapter's only if
        no base model is listed."""
        return min(self.cards, key=lambda name: ("parent" in self.cards[name], name))

    def listing(self) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "owned_by": "ucm", **self.cards[name]} for name in sorted(self.cards)]
