"""Who may use the box: API keys (keys.py), each key's share (shares.py), rooms and their client
secrets for the page (rooms.py), the gate every request passes (gate.py), Wyoming's address allow-list
(wyoming_allow.py)."""
