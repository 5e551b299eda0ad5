"""Routes of the OpenAI protocol, mounted at /v1/ (OpenAI's paths have no trailing slash)."""
from django.urls import path

from inference.api.openai import views

urlpatterns = [
    path("models", views.list_models, name="openai-models"),
    path("models/<path:model>", views.retrieve_model, name="openai-model"),
    path("completions", views.completions, name="openai-completions"),
    path("chat/completions", views.chat_completions, name="openai-chat-completions"),
]
