"""A local endpoint speaking OpenAI's Chat Completions REST API that plays scripted conversations.

The real `openai` SDK talks to it unchanged (`base_url="http://HOST:PORT/v1"`). Scripts, turn
choice and the call ledger are the scripted Gemini endpoint's (`scripted_gemini.player`,
`scripted_gemini.endpoint`); this package only reads and writes the Chat Completions shapes.
"""
