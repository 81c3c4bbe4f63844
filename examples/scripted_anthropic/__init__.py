"""A local endpoint speaking Anthropic's Messages REST API that plays scripted conversations.

The real `anthropic` SDK talks to it unchanged (`base_url="http://HOST:PORT"`). Scripts, turn
choice and the call ledger are the scripted Gemini endpoint's (`scripted_gemini.player`,
`scripted_gemini.endpoint`); this package only reads and writes the Messages shapes.
"""
