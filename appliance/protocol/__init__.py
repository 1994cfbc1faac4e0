"""The API's data, shared by every layer that speaks it: requests and responses (`messages`), KServe
tensors on the wire (`tensors`), and what is shown of QUIC peers (`peers`). No I/O, no models."""
