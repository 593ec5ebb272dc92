"""The target model: its config and tokenizer, chat-template tokenization, and running it in transformers."""
