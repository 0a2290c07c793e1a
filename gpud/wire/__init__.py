"""The client's contract with gpud, one package: the frames and the protocol's vocabulary (frames:
framing, limits, error codes, the ops; standard library only), the envelope as msgspec structs
(protocol: requests, responses, events, each op's arguments), each op's typed result (replies,
with RESULTS and decode_result) and the table ops' results (tables). Standard library and msgspec
only. gpudctl imports gpud.wire.frames and gpud.mig_text, nothing else of gpud at run time: it reads
replies with msgpack, typed against the structs here for mypy (gpud.cli.view), and imports the
structs only to fill a field an older gpud did not send. This face imports nothing, so a client
pays only for what it uses.
"""
