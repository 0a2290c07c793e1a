"""The client's contract with gpud, one package: the socket protocol's envelope (protocol: framing,
requests, responses, events, each op's arguments, error codes), each op's typed result (replies,
with RESULTS and decode_result) and the table ops' results (tables). Standard library and msgspec
only: gpudctl imports this package and gpud.mig_text, nothing else of gpud, and every import here
is paid by every gpudctl run. This face imports nothing, so a client pays only for what it uses.
"""
