package app

// The messages services exchange, following DeathStarBench's Thrift structs.

// Creator is a post's author.
type Creator struct {
	UserID   int64  `json:"user_id"`
	Username string `json:"username"`
}

// UserMention is an @username resolved to a user id.
type UserMention struct {
	UserID   int64  `json:"user_id"`
	Username string `json:"username"`
}

// URL is a link and its shortened form.
type URL struct {
	ShortenedURL string `json:"shortened_url"`
	ExpandedURL  string `json:"expanded_url"`
}

// Media is an attachment.
type Media struct {
	MediaID   int64  `json:"media_id"`
	MediaType string `json:"media_type"`
}

// Post is a stored post.
type Post struct {
	PostID       int64         `json:"post_id"`
	Creator      Creator       `json:"creator"`
	ReqID        int64         `json:"req_id"`
	Text         string        `json:"text"`
	UserMentions []UserMention `json:"user_mentions"`
	Media        []Media       `json:"media"`
	URLs         []URL         `json:"urls"`
	Timestamp    int64         `json:"timestamp"`
	PostType     int           `json:"post_type"`
}

// TimelineRead asks for the posts start..stop-1 (newest first) of a user's timeline.
type TimelineRead struct {
	UserID int64 `json:"user_id"`
	Start  int   `json:"start"`
	Stop   int   `json:"stop"`
}

// Posts is a list of posts.
type Posts struct {
	Posts []Post `json:"posts"`
}

// Empty is an answer with nothing in it.
type Empty struct{}
