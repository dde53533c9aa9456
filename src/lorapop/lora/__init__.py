"""LoRA adapter slots on one frozen base model: the bank, routing, evolution, PEFT I/O."""

from lorapop.lora.bank import DEFAULT_TARGETS, AdapterBank, SlotState

__all__ = ["DEFAULT_TARGETS", "AdapterBank", "SlotState"]
