// Starts Swagger UI on /docs. It lives in a file, not in the page, because the page's
// Content-Security-Policy (api/headers.py) runs no inline script. The URLs are relative to
// /docs, so the page works under whatever prefix a proxy serves the API at.
"use strict";

const root = document.getElementById("swagger-ui");
window.ui = SwaggerUIBundle({
  url: root.dataset.openapiUrl,
  domNode: root,
  layout: "BaseLayout",
  presets: [SwaggerUIBundle.presets.apis],
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  // Nothing is sent off this server: no badge from the public validator.
  validatorUrl: null,
});
