"""Push mode: producers WRITE requests into the blocks decoders expect (see docs/push.md).

`wire` holds the notifications, `plan` what one producer rank writes into one decoder rank,
`sender` the producer side and `receiver` the decoder side; `kvrdma.Worker` is the API.
"""
