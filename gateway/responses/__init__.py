"""The Responses API and Conversations: the request and its chat form, the typed output events,
stored state (responses and conversations, SQLite or Redis), background runs, custom tools."""
