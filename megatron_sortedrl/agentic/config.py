"""Configuration of tool-using rollouts (one section of the run config, `tools.*`).

Kept beside the agentic code so it stays importable on its own; `megatron_sortedrl.config` composes it into
the run schema. With `tools.tools` empty (the default) a sample is one response, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sortedrl.errors import ConfigError


@dataclass
class ToolsConfig:
    tools: list[str] = field(default_factory=list, metadata={
        "help": "Tools every prompt may call: built-in names (calculator, python) or dotted paths to a tool "
                "(module.attr); a data row's own tool list narrows it. Empty: one response per sample, no tools."})
    parser: str = field(default="hermes", metadata={
        "help": "How tool calls are read from an assistant turn: hermes (Qwen/Hermes <tool_call>{json}</tool_call>) "
                "or a dotted path to a parser function."})
    max_turns: int = field(default=8, metadata={
        "help": "Assistant turns per trajectory; the turn that reaches it ends the trajectory even if it calls a "
                "tool. The token budget of the whole trajectory is rollout.max_response_length.", "min": 1})
    timeout_s: float = field(default=10.0, metadata={
        "help": "Seconds one tool call may run; past it the call is stopped and answered with a timeout message.",
        "gt": 0})
    max_output_chars: int = field(default=2000, metadata={
        "help": "Longest tool answer in characters; a longer one is cut and says so.", "min": 1})
    workers: int = field(default=2, metadata={
        "help": "Processes that run tool calls, off the engines and the driver.", "min": 1})

    def __post_init__(self) -> None:
        for name in self.tools:
            if not isinstance(name, str) or not name.strip():
                raise ConfigError("tools.tools", self.tools, "a list of tool names or dotted paths (module.attr)")
        if self.max_turns < 1:
            raise ConfigError("tools.max_turns", self.max_turns, "an integer >= 1")
