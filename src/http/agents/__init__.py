"""The agents' APIs: OpenAI's Responses (`/v1/responses`) and Anthropic's Messages
(`/v1/messages`), the routes Codex, the OpenAI Agents SDK and Claude Code speak.

Both are thin translations onto the chat route's machinery (`turn`): a request becomes the
`ChatCompletionRequest` the chat route would get (messages, tools, tool_choice, the response
format), so the prompt is the chat template's, the tool and reasoning parsers are the
server's, forced tool choices carry the chat route's JSON-schema constraint, and the prefix
cache sees the same tokens. Each API keeps its own modules:

- Responses: `responses_protocol` (request, items, response object and stream events as
  msgspec Structs), `responses_input` (body decoding, input items to the chat request, the
  chat code's field names rewritten to the Responses ones in errors), `responses_stream` (the
  output items and their events), `responses_store` (the bounded LRU + TTL store behind
  `previous_response_id` and GET), `responses_route` (the routes, background runs, cancel).
- Messages: `messages_protocol` (shapes), `messages_translate` (a Messages request to the chat
  request, Claude Code's attribution line stripped), `messages_stream` (content blocks and
  their events, pings), `messages_errors` (Anthropic's error bodies), `messages_route`.

The app mounts both through `routes(guard)` as it mounts the admin routes.
"""
