"""Structured outputs and tool calling, apart from tensors: JSON-schema and Lark grammars for llguidance,
tool definitions, each model family's tool-call format (its parser and its grammar), reasoning blocks.

Torch-free and engine-free, so that the node (which validates requests and parses outputs) and the engine
(which constrains sampling with the grammars built here) share one definition of every format.
"""
